"""Prefill/decode disaggregation on the real SmolLM2: one prefill and one decode worker behind the router.

Outputs equal an aggregated worker's; a cut or corrupt transfer is recovered by recompute; pinned
pages are freed on acknowledgement, on timeout and when the client leaves; both page pools are
full again after every scenario; the trace of a request shows every layer in order.
"""

from __future__ import annotations

import time

import httpx
import pytest

from jaxserve.engine.kv_transfer import KVPayload
from router.app import build_router_app
from router.cli import add_trace_args, run_trace
from router.config import RouterConfig
from server.config import ServerConfig
from server.pd import HttpKVTransport, PDConfig
from server.runner import ServerThread, serve_in_thread
from tests.conftest import REAL_ENGINE_ARGS

pytestmark = pytest.mark.slow

SYSTEM = ("You are a helpful assistant who answers questions about geography with care and precision, "
          "and who always names the country.")
MAX_TOKENS = 6


def _chat(user: str, system: str = SYSTEM) -> dict:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": MAX_TOKENS, "temperature": 0}


@pytest.fixture(scope="module")
def pd():
    """(router client, prefill server, decode server, prefill engine, decode engine)."""
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine.model_loading import load_model
    from jaxserve.engine_args import EngineArgs

    args = EngineArgs(**REAL_ENGINE_ARGS)
    loaded = load_model(args, progress=False)
    engines = [AsyncEngine(LLMEngine(args, loaded=loaded, progress=False)) for _ in range(2)]
    servers = [serve_in_thread(e, ServerConfig(port=0)) for e in engines]
    cfg = RouterConfig(port=0, prefill_workers=(servers[0].url,), decode_workers=(servers[1].url,),
                       probe_interval_s=0.1, pd_min_uncached_tokens=16)
    router = ServerThread(build_router_app(cfg), "127.0.0.1", 0).start()
    client = httpx.Client(base_url=router.url, timeout=120)
    deadline = time.monotonic() + 10
    while client.get("/ready").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    yield client, servers[0], servers[1], engines[0], engines[1]
    client.close()
    router.stop()
    for s, e in zip(servers, engines, strict=True):
        s.stop()
        e.shutdown()


def _assert_pools_full(*engines) -> None:
    """Every page is free or held by the cache alone (evictable): nothing pinned, locked or leaked."""
    for engine in engines:
        deadline = time.monotonic() + 20
        while engine.call_on_engine(lambda e: e.has_unfinished_requests()) and time.monotonic() < deadline:
            time.sleep(0.05)
        engine.check_integrity()
        free, usable, locked = engine.call_on_engine(lambda e: (
            e.scheduler.pool.num_free + e.scheduler.cache.num_evictable_pages, e.scheduler.pool.num_usable_pages,
            e.scheduler.cache.num_locked_pages))
        assert (free, locked) == (usable, 0)


def _events(client: httpx.Client, request_id: str) -> list[dict]:
    return client.get(f"/v1/requests/{request_id}/trace").json()["records"]


def test_disaggregated_outputs_equal_an_aggregated_worker_and_the_trace_shows_every_layer(pd, capsys):
    client, pre, dec, pe, de = pd
    for i, user in enumerate(["What is the capital of France?", "Name a large river in Egypt."]):
        body = _chat(user)
        aggregated = httpx.post(pre.url + "/v1/chat/completions", json=body, timeout=120).json()
        split = client.post("/v1/chat/completions", json=body, headers={"x-request-id": f"pd-{i}"})
        assert split.status_code == 200 and split.headers["x-jaxserve-worker"] == dec.url
        assert split.json()["choices"][0]["message"] == aggregated["choices"][0]["message"]
        records = _events(client, f"pd-{i}")
        imported = [r for r in records if r["event"] == "imported"]
        assert imported and imported[0]["where"] == dec.url and imported[0]["data"]["tokens"] >= 32
        # Pages the decode worker already caches (the shared system prompt, after the first) are not resent.
        assert imported[0]["data"]["pages_written"] >= (2 if i == 0 else 1)
        # The decode worker's admission found the imported pages: a prefix hit of the whole pages.
        first = next(r for r in records if r["event"] == "scheduled" and r["where"] == dec.url)["data"]
        assert first["prefix_hit_tokens"] == imported[0]["data"]["tokens"] and first["tokens"] < 16
        # Its first token (from the last prompt token, recomputed there) is the one the prefill sampled.
        tokens = next(r for r in records if r["event"] == "tokens" and r["where"] == dec.url)["data"]
        assert tokens["token_ids"][0] == imported[0]["data"]["prefill_first_token"]
    _assert_pools_full(pe, de)
    # Every layer, in order of first appearance, with non-decreasing times.
    records = _events(client, "pd-0")
    times = [r["t"] for r in records]
    assert times == sorted(times)
    order = [r["layer"] for r in records]
    first_seen = [order.index(layer) for layer in ("L2", "L3", "L1", "L4", "L6", "L7", "L5")]
    assert first_seen == sorted(first_seen)
    assert {r["event"] for r in records} >= {"picked", "plan", "pinned", "sent", "imported", "unpinned", "queued",
                                            "scheduled", "bucket", "kernel", "tokens", "finished"}
    ns = add_trace_args(__import__("argparse").ArgumentParser()).parse_args(["pd-0", "--url", client.base_url.__str__()])
    assert run_trace(ns) == 0
    out = capsys.readouterr().out
    assert "imported" in out and "kernel" in out and out.count("\n") >= len(records)


class _CuttingTransport(HttpKVTransport):
    """Delivers only the first half of the payload, as if the connection dropped mid-way."""

    async def fetch(self, source, timeout):
        r = await self._http().get(source, timeout=timeout)
        return KVPayload.decode(r.content[: len(r.content) // 2])


class _CorruptingTransport(HttpKVTransport):
    """Delivers the payload with one byte flipped."""

    async def fetch(self, source, timeout):
        data = bytearray((await self._http().get(source, timeout=timeout)).content)
        data[-3] ^= 0x40
        return KVPayload.decode(bytes(data))


@pytest.mark.parametrize("transport, event", [(_CuttingTransport, "transfer_failed"),
                                              (_CorruptingTransport, "not_ready")])
def test_a_failed_transfer_is_recovered_by_recompute(pd, transport, event):
    client, pre, dec, pe, de = pd
    state = dec.app.state
    # Start from an empty decode cache, so the recompute really computes the prompt.
    assert de.call_on_engine(lambda e: e.reset_prefix_cache())
    # A prompt of its own: the router would not split one it believes the decode worker caches.
    body = _chat("Which country is Lisbon in?", system=f"In this {event} quiz, answer each question about "
                                                      "European capitals with the name of one country.")
    aggregated = httpx.post(pre.url + "/v1/chat/completions", json=body, timeout=120).json()
    state.pd.transport = transport()
    try:
        rid = f"cut-{event}"
        r = client.post("/v1/chat/completions", json=body, headers={"x-request-id": rid})
    finally:
        state.pd.transport = HttpKVTransport()
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"] == aggregated["choices"][0]["message"]
    records = _events(client, rid)
    failed = [x for x in records if x["event"] == event]
    assert failed and failed[0]["data"]["fallback"] == "recompute"
    assert not [x for x in records if x["event"] == "imported"]
    first = next(x for x in records if x["event"] == "scheduled" and x["where"] == dec.url)["data"]
    assert first["prefix_hit_tokens"] == 0  # nothing was imported: the whole prompt was computed
    assert httpx.get(pre.url + "/v1/pd/info").json()["pinned_pages"] == 0
    _assert_pools_full(pe, de)


def test_pinned_pages_are_freed_on_ack_on_timeout_and_when_the_client_leaves(pd):
    client, pre, dec, pe, de = pd
    body = {"kind": "chat", "body": _chat("Where is Mount Fuji?")}
    meta = httpx.post(pre.url + "/v1/pd/prefill", json=body, timeout=120).json()
    assert len(meta["page_ids"]) >= 2 and meta["first_token"] is not None
    assert pe.call_on_engine(lambda e: e.scheduler.cache.num_locked_pages) >= len(meta["page_ids"])
    assert httpx.delete(f"{pre.url}/v1/pd/kv/{meta['transfer_id']}").status_code == 200
    assert httpx.get(f"{pre.url}/v1/pd/kv/{meta['transfer_id']}").status_code == 404  # freed pages are never read
    _assert_pools_full(pe)

    pd_worker = pre.app.state.pd
    pd_worker.config = PDConfig(pin_timeout_s=2.0)
    try:
        meta = httpx.post(pre.url + "/v1/pd/prefill", json=body, timeout=120).json()
        assert httpx.get(pre.url + "/v1/pd/info").json()["pinned_pages"] == len(meta["page_ids"])
        deadline = time.monotonic() + 10
        while httpx.get(pre.url + "/v1/pd/info").json()["pinned_pages"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert time.time() >= meta["expires_at"] - 0.1  # freed by the timeout, not before it
        assert httpx.get(pre.url + "/v1/pd/info").json()["pinned_pages"] == 0
    finally:
        pd_worker.config = PDConfig()
    _assert_pools_full(pe)

    # A streaming client that leaves after the first chunk: the decode request is aborted and no pin survives.
    assert de.call_on_engine(lambda e: e.reset_prefix_cache())
    leaving = {**_chat("Where is Kyoto?", system="A travel guide for Japan: answer in one short sentence, "
                                                "naming the region and the nearest large city."),
               "stream": True, "max_tokens": 40}
    with client.stream("POST", "/v1/chat/completions", json=leaving, headers={"x-request-id": "leaver"}) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    time.sleep(0.3)
    assert "imported" in {x["event"] for x in _events(client, "leaver")}
    assert httpx.get(pre.url + "/v1/pd/info").json()["pinned_pages"] == 0
    _assert_pools_full(pe, de)


def _prefix_hits(url: str) -> float:
    from router.workers import parse_metrics  # noqa: F401 - same scrape as the router's

    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("vllm:prefix_cache_hits_total") or line.startswith("vllm:prefix_cache_hits{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:prefix_cache_hits in /metrics")


def test_aggregated_prefix_routing_hits_the_cache_of_the_worker_holding_the_prompt(pd):
    _, pre, dec, pe, de = pd
    app = build_router_app(RouterConfig(port=0, workers=(pre.url, dec.url), probe_interval_s=0.05))
    router = app.state.router
    system = ("You are the archivist of a small museum of maritime history. Answer visitors briefly, "
              "mention one exhibit by name, and never invent dates that are not on the labels.")
    with ServerThread(app, "127.0.0.1", 0).start() as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        first = c.post("/v1/chat/completions", json={**_chat("Hello!", system), "max_tokens": 1})
        home = first.headers["x-jaxserve-worker"]
        other = dec.url if home == pre.url else pre.url
        deadline = time.monotonic() + 30
        # The worker's KV events reach the router, and its scraped load shows the first request done (a busy
        # home would rightly lose a pick to an idle worker).
        while (router.index.num_exact(home) < 2 or router.pool.workers[home].queue > 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert router.index.num_exact(home) >= 2 and router.pool.workers[home].queue == 0
        router.index._approx.clear()  # only the events may explain the picks below
        before = {home: _prefix_hits(home), other: _prefix_hits(other)}
        for i, user in enumerate(["Where is the oldest ship?", "Is there a lighthouse lens?"]):
            r = c.post("/v1/chat/completions", json={**_chat(user, system), "max_tokens": 1},
                       headers={"x-request-id": f"agg-{i}"})
            assert r.status_code == 200 and r.headers["x-jaxserve-worker"] == home
            pick = next(x for x in router.trace.get(f"agg-{i}") if x["event"] == "picked")["data"]
            row = next(x for x in pick["candidates"] if x["url"] == home)
            assert row["index"] == "exact" and row["matched_pages"] >= 2
        assert _prefix_hits(home) - before[home] >= 2 * 2 * 16  # both requests reused the system prompt's pages
        assert _prefix_hits(other) == before[other]
    _assert_pools_full(pe, de)
