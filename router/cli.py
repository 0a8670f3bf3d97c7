"""`jaxserve router` and `jaxserve trace`: flags and entry points."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from router.config import POLICIES, CostWeights, RouterConfig


def add_router_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The router's flags."""
    d, w = RouterConfig(), CostWeights()
    parser.add_argument("--worker", action="append", default=[], metavar="URL",
                        help="an aggregated worker (`jaxserve serve`); repeat for several")
    parser.add_argument("--prefill-worker", action="append", default=[], metavar="URL",
                        help="a `--role prefill` worker (with --decode-worker: disaggregated serving)")
    parser.add_argument("--decode-worker", action="append", default=[], metavar="URL",
                        help="a `--role decode` worker")
    parser.add_argument("--host", default=d.host, help="address to listen on")
    parser.add_argument("--port", type=int, default=d.port, help="TCP port (0 picks a free one)")
    parser.add_argument("--policy", choices=POLICIES, default=d.policy,
                        help="how a worker is picked (prefix: cached prefix and load, see --prefix-weight)")
    g = parser.add_argument_group("prefix policy cost: score = W_prefix*hit - W_load*queue/(1+max queue) "
                                  "- W_kv*kv_usage; hit counts 0 on a worker whose queue exceeds the "
                                  "shortest by more than the hotspot threshold")
    g.add_argument("--prefix-weight", type=float, default=w.prefix, help="W_prefix")
    g.add_argument("--load-weight", type=float, default=w.load, help="W_load")
    g.add_argument("--kv-weight", type=float, default=w.kv, help="W_kv")
    g.add_argument("--lora-weight", type=float, default=w.lora, help="W_lora")
    g.add_argument("--hotspot-threshold", type=int, default=w.hotspot_threshold,
                   help="queue excess over the least loaded worker past which a prefix hit is ignored")
    parser.add_argument("--session-header", default=d.session_header, help="header naming the session")
    parser.add_argument("--probe-interval", type=float, default=d.probe_interval_s,
                        help="seconds between reads of each worker's /ready, /metrics and KV events")
    parser.add_argument("--probe-timeout", type=float, default=d.probe_timeout_s,
                        help="seconds one probe request may take")
    parser.add_argument("--probe-failure-threshold", type=int, default=d.probe_failure_threshold,
                        help="probes in a row that time out before a worker stops getting traffic "
                             "(an error answer or a refused connection stops it at once)")
    parser.add_argument("--approx-ttl", type=float, default=d.approx_ttl_s,
                        help="seconds a routing-time guess of a worker's cached prefix counts")
    parser.add_argument("--page-size", type=int, default=d.page_size,
                        help="page size for hashing until a worker reports its own")
    parser.add_argument("--max-attempts", type=int, default=d.max_attempts,
                        help="workers tried per request when one is unreachable or refuses")
    parser.add_argument("--request-timeout", type=float, default=d.request_timeout_s)
    parser.add_argument("--pd-min-uncached-tokens", type=int, default=d.pd_min_uncached_tokens,
                        help="disaggregate only when at least this many prompt tokens are not cached "
                             "on the decode worker")
    parser.add_argument("--log-level", default=d.log_level,
                        choices=["critical", "error", "warning", "info", "debug"])
    return parser


def router_config_from_args(ns: argparse.Namespace) -> RouterConfig:
    """The `RouterConfig` the parsed flags describe."""
    return RouterConfig(
        host=ns.host, port=ns.port, workers=tuple(ns.worker), prefill_workers=tuple(ns.prefill_worker),
        decode_workers=tuple(ns.decode_worker), policy=ns.policy,
        weights=CostWeights(ns.prefix_weight, ns.load_weight, ns.kv_weight, ns.hotspot_threshold, ns.lora_weight),
        session_header=ns.session_header, probe_interval_s=ns.probe_interval,
        probe_timeout_s=ns.probe_timeout, probe_failure_threshold=ns.probe_failure_threshold, approx_ttl_s=ns.approx_ttl,
        page_size=ns.page_size, request_timeout_s=ns.request_timeout, max_attempts=ns.max_attempts,
        pd_min_uncached_tokens=ns.pd_min_uncached_tokens, log_level=ns.log_level)


def run_router(ns: argparse.Namespace) -> int:
    """Serve the router until SIGTERM/SIGINT."""
    from hypercorn.asyncio import serve

    from router.app import build_router_app
    from server.cli import setup_logging
    from server.runner import bind_socket, hypercorn_config

    config = router_config_from_args(ns)
    setup_logging(config.log_level)
    app = build_router_app(config)
    sock = bind_socket(config.host, config.port)
    sock.listen(2048)
    host, port = sock.getsockname()[:2]
    # The bound address on stdout, so whoever started the router (a script, a test) can find it.
    print(f"jaxserve router listening on http://{host}:{port}", flush=True)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(app, hypercorn_config(sock), shutdown_trigger=stop.wait)

    asyncio.run(main())
    logging.getLogger("jaxserve.router").info("stopped")
    return 0


def add_trace_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of `jaxserve trace`."""
    parser.add_argument("request_id", help="the request's id (its X-Request-Id)")
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="a router's or a worker's URL")
    parser.add_argument("--json", action="store_true", help="print the raw JSON instead of a timeline")
    return parser


def run_trace(ns: argparse.Namespace) -> int:
    """Fetch a request's trace and print it as a timeline."""
    import json

    import httpx

    from router.timeline import format_timeline

    try:
        r = httpx.get(f"{ns.url.rstrip('/')}/v1/requests/{ns.request_id}/trace", timeout=10)
    except httpx.HTTPError as e:
        print(f"cannot reach {ns.url}: {e}")
        return 1
    if r.status_code != 200:
        print(f"{r.status_code}: {r.text}")
        return 1
    records = r.json()["records"]
    print(json.dumps(records, indent=2) if ns.json else format_timeline(ns.request_id, records))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m router`: the same as `jaxserve router`."""
    parser = argparse.ArgumentParser(prog="jaxserve router",
                                     description="Route OpenAI-compatible requests over jaxserve workers.")
    add_router_args(parser)
    return run_router(parser.parse_args(argv))
