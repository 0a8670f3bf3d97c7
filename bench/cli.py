"""`jaxserve bench offline | serve | compare`: the flags and the handlers."""

from __future__ import annotations

import argparse
import sys

from jaxserve.cli import json_schema_arg
from jaxserve.engine_args import EngineArgs


def _add_offline(sub) -> None:
    p = sub.add_parser("offline", help="engine throughput, batch-1 decode against the bandwidth floor",
                       description="Offline benchmark of the engine on a workload (the fixed chat prompts by "
                                   "default): output tokens/s "
                                   "at each concurrency, batch-1 decode step time next to the memory-bandwidth "
                                   "floor, host share of step time, compilations after warmup.")
    EngineArgs.add_cli_args(p)
    # Every concurrency runs at once: the engine needs that many sequence slots.
    p.set_defaults(max_num_seqs=256)
    g = p.add_argument_group("benchmark")
    g.add_argument("--concurrency", type=int, nargs="+", default=[32, 256], help="requests sent at once, per run")
    _workload_args(p, offline=True)
    g.add_argument("--bandwidth-mib", type=int, default=512, help="buffer size of the bandwidth measurement")
    g.add_argument("--skip-batch1", action="store_true", help="leave out the batch-1 run (and the floor)")
    g.add_argument("--json-schema", default=None, metavar="SCHEMA",
                   help="run the concurrency runs under this JSON schema (its JSON text or a file)")
    g.add_argument("--lora-name", default=None, metavar="NAME",
                   help="run every request through this LoRA adapter (with --enable-lora --lora-modules NAME=PATH)")
    g.add_argument("--result-file", default=None, help="where to write the JSON (default bench/results/)")
    g.add_argument("--quiet", action="store_true", help="no progress bars")


def _run_offline(ns: argparse.Namespace) -> int:
    from bench.offline import OfflineConfig, format_report, run_offline, write_result

    args = EngineArgs.from_cli_args(ns)
    if args.max_num_seqs < max(ns.concurrency):
        print(f"note: max_num_seqs {args.max_num_seqs} < concurrency {max(ns.concurrency)}: "
              "the rest of the requests wait", file=sys.stderr)
    cfg = OfflineConfig(concurrency=tuple(ns.concurrency), workload=_workload_spec(ns),
                        bandwidth_bytes=ns.bandwidth_mib << 20, skip_batch1=ns.skip_batch1,
                        json_schema=json_schema_arg(ns.json_schema) if ns.json_schema else None,
                        lora_name=ns.lora_name)
    result = run_offline(args, cfg, progress=not ns.quiet,
                         log=lambda m: print(m, file=sys.stderr, flush=True))
    print(format_report(result))
    path = write_result(result, ns.result_file, "offline")
    print(f"wrote {path}")
    return 0


def _add_embed(sub) -> None:
    from bench.workloads import DEFAULT_PROMPTS, WorkloadSpec

    p = sub.add_parser("embed", help="an embedding model's throughput (--runner pooling), against HF transformers",
                       description="Embeddings/s and prompt tokens/s of the model run as an embedding model, for "
                                   "each batch size (texts from the workload, the fixed chat prompts by default), "
                                   "with --hf-peer next to transformers' backbone on the same token ids.")
    EngineArgs.add_cli_args(p)
    p.set_defaults(max_num_seqs=256)
    g = p.add_argument_group("benchmark")
    g.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 256], help="texts submitted at once, per run")
    g.add_argument("--repeats", type=int, default=3, help="timed runs per batch size (the median is reported)")
    g.add_argument("--hf-peer", action="store_true", help="also time transformers (torch, CPU) on the same inputs")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=["fixed", "random"], default="fixed")
    w.add_argument("--dataset-path", default=None, help=f"fixed: JSONL of chat prompts (default {DEFAULT_PROMPTS})")
    w.add_argument("--random-input-len", type=int, default=WorkloadSpec().random_input_len)
    g.add_argument("--result-file", default=None, help="where to write the JSON (default bench/results/)")
    g.add_argument("--quiet", action="store_true", help="no progress bars")


def _run_embed(ns: argparse.Namespace) -> int:
    from bench.embed import EmbedConfig, format_report, run_embed
    from bench.offline import write_result
    from bench.workloads import WorkloadSpec

    spec = WorkloadSpec(name=ns.workload, dataset_path=ns.dataset_path, random_input_len=ns.random_input_len,
                        random_range_ratio=0.0, seed=ns.seed)
    cfg = EmbedConfig(batch_sizes=tuple(ns.batch_sizes), workload=spec, repeats=ns.repeats, hf_peer=ns.hf_peer)
    result = run_embed(EngineArgs.from_cli_args(ns), cfg, progress=not ns.quiet,
                       log=lambda m: print(m, file=sys.stderr, flush=True))
    print(format_report(result))
    print(f"wrote {write_result(result, ns.result_file, 'embed')}")
    return 0


def _workload_args(p: argparse.ArgumentParser, offline: bool = False) -> None:
    from bench.workloads import DEFAULT_PROMPTS, WORKLOADS, WorkloadSpec

    d = WorkloadSpec()
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=[x for x in WORKLOADS if not (offline and x == "multi-turn")],
                   default=d.name)
    if not offline:
        w.add_argument("--num-prompts", type=int, default=d.num_prompts,
                       help="requests (multi-turn: conversations); shared-prefix uses groups x prompts per group")
    if not offline:  # offline: the engine's --seed seeds the workload too
        w.add_argument("--seed", type=int, default=d.seed)
    w.add_argument("--output-len", type=int, default=d.output_len, help="tokens generated per request (forced)")
    w.add_argument("--dataset-path", default=None, help=f"fixed: JSONL of chat prompts (default {DEFAULT_PROMPTS})")
    w.add_argument("--random-input-len", type=int, default=d.random_input_len)
    w.add_argument("--random-range-ratio", type=float, default=d.random_range_ratio,
                   help="random: lengths uniform in [len*(1-r), len*(1+r)]")
    if not offline:
        w.add_argument("--random-images", type=int, default=d.random_images,
                       help="random: images per request, as chat messages (an image-text model's server)")
        w.add_argument("--random-image-size", default="x".join(map(str, d.random_image_size)), metavar="WxH",
                       help="random: the images' width x height in pixels (random pixels, PNG)")
    w.add_argument("--gsp-num-groups", type=int, default=d.gsp_num_groups)
    w.add_argument("--gsp-prompts-per-group", type=int, default=d.gsp_prompts_per_group)
    w.add_argument("--gsp-system-prompt-len", type=int, default=d.gsp_system_prompt_len)
    w.add_argument("--gsp-question-len", type=int, default=d.gsp_question_len)
    if not offline:
        w.add_argument("--multi-turn-num-turns", type=int, default=d.multi_turn_num_turns)
        w.add_argument("--multi-turn-input-len", type=int, default=d.multi_turn_input_len,
                       help="multi-turn: tokens of each user message")


def _size(value: str | None) -> tuple[int, int]:
    """A `WxH` flag as (width, height); None: the workload's default."""
    from bench.workloads import WorkloadSpec

    if value is None:
        return WorkloadSpec().random_image_size
    w, sep, h = value.lower().partition("x")
    if not sep or not w.isdigit() or not h.isdigit():
        raise SystemExit(f"--random-image-size must be WIDTHxHEIGHT, got {value!r}")
    return int(w), int(h)


def _workload_spec(ns: argparse.Namespace):
    from bench.workloads import WorkloadSpec

    d = WorkloadSpec()
    return WorkloadSpec(
        name=ns.workload, num_prompts=getattr(ns, "num_prompts", d.num_prompts), seed=ns.seed,
        dataset_path=ns.dataset_path, output_len=ns.output_len, random_input_len=ns.random_input_len,
        random_range_ratio=ns.random_range_ratio, gsp_num_groups=ns.gsp_num_groups,
        random_images=getattr(ns, "random_images", 0), random_image_size=_size(getattr(ns, "random_image_size", None)),
        gsp_prompts_per_group=ns.gsp_prompts_per_group, gsp_system_prompt_len=ns.gsp_system_prompt_len,
        gsp_question_len=ns.gsp_question_len,
        multi_turn_num_turns=getattr(ns, "multi_turn_num_turns", d.multi_turn_num_turns),
        multi_turn_input_len=getattr(ns, "multi_turn_input_len", d.multi_turn_input_len),
    )


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="load an OpenAI-compatible server on this machine",
                       description="Send a workload to an OpenAI-compatible server on 127.0.0.1 (streaming, "
                                   "output lengths forced with ignore_eos/min_tokens) and report TTFT, TPOT, "
                                   "ITL, E2EL, throughput and goodput as `vllm bench serve` defines them.")
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (loopback only)")
    g.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    g.add_argument("--api-key", default=None, help="sent as a bearer token")
    g.add_argument("--tokenizer", default=None,
                   help="GGUF file or HF directory whose tokenizer builds and counts the prompts "
                        "(default: the bundled SmolLM2)")
    g.add_argument("--label", default="", help="name of the system in reports (default: the model name)")
    _workload_args(p)
    ld = p.add_argument_group("load")
    ld.add_argument("--request-rate", type=float, default=float("inf"),
                    help="requests per second (inf: all at once)")
    ld.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrivals; 1 = Poisson")
    ld.add_argument("--max-concurrency", type=int, nargs="+", default=None,
                    help="most requests in flight; several values run one after the other (a sweep)")
    ld.add_argument("--max-duration", type=float, default=None, help="seconds after which no request is sent")
    ld.add_argument("--drain-timeout", type=float, default=600.0,
                    help="seconds requests in flight get after --max-duration before they are cancelled")
    ld.add_argument("--timeout", type=float, default=600.0, help="per-request HTTP timeout (s)")
    ld.add_argument("--warmup-requests", type=int, default=1, help="short untimed requests sent first")
    ld.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    o = p.add_argument_group("report")
    o.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000")
    o.add_argument("--percentiles", default="50,90,99", help="comma-separated percentiles")
    o.add_argument("--result-file", default=None, help="where to write the JSON (default bench/results/)")
    o.add_argument("--no-save-requests", action="store_true", help="leave per-request timings out of the JSON")
    o.add_argument("--keep-caches", action="store_true",
                   help="leave the server's prefix and image caches as they are between runs (by default each run "
                        "starts with them emptied, when the server has /reset_prefix_cache and /reset_mm_cache)")
    o.add_argument("--plot", default=None, metavar="DIR", help="write PNG charts there (needs matplotlib)")


def _run_serve(ns: argparse.Namespace) -> int:
    import json

    from bench.client import check_loopback
    from bench.metrics import parse_slos
    from bench.offline import write_result
    from bench.serve import LoadConfig, ServeBenchConfig, format_serve_report, run_serve_benchmark

    check_loopback(ns.base_url)
    spec = _workload_spec(ns)
    percentiles = tuple(float(x) for x in ns.percentiles.split(",") if x.strip())
    load = LoadConfig(request_rate=ns.request_rate, burstiness=ns.burstiness, max_duration_s=ns.max_duration,
                      drain_timeout_s=ns.drain_timeout, timeout_s=ns.timeout, seed=ns.seed,
                      extra_body=json.loads(ns.extra_body) if ns.extra_body else {})
    cfg = ServeBenchConfig(base_url=ns.base_url, model=ns.model, api_key=ns.api_key, label=ns.label,
                           concurrencies=tuple(ns.max_concurrency or [None]), load=load,
                           slos_ms=parse_slos(ns.goodput), percentiles=percentiles,
                           warmup_requests=ns.warmup_requests, save_requests=not ns.no_save_requests,
                           reset_caches=not ns.keep_caches)
    tokenizer = _tokenizer(ns.tokenizer)
    result = run_serve_benchmark(cfg, spec, tokenizer, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(format_serve_report(result, percentiles))
    path = write_result(result, ns.result_file, f"serve-{spec.name}")
    print(f"wrote {path}")
    if ns.plot:
        _plot([result], ns.plot)
    return 0 if all(r["metrics"]["completed"] for r in result["runs"]) else 1


def _tokenizer(path: str | None):
    from jaxserve.loader import resolve_model
    from jaxserve.tokenizer import Tokenizer

    path = resolve_model(path)
    return Tokenizer.from_gguf(path) if str(path).endswith(".gguf") else Tokenizer.from_hf_dir(path)


def _plot(results: list, outdir: str, names=None) -> None:
    from bench.plots import have_matplotlib, plot_results

    if not have_matplotlib():
        print("--plot: matplotlib is not installed (pip install matplotlib); no charts written", file=sys.stderr)
        return
    for path in plot_results(results, outdir, names):
        print(f"wrote {path}")


def _add_compare(sub) -> None:
    p = sub.add_parser("compare", help="result files side by side, with ratios to the first",
                       description="Print the metrics of bench result files side by side; ratios are to the "
                                   "first file. Rows match on workload, concurrency and rate.")
    p.add_argument("results", nargs="+", help="JSON files written by bench serve or bench offline")
    p.add_argument("--names", nargs="+", default=None, help="column names (default: each file's system)")
    p.add_argument("--plot", default=None, metavar="DIR", help="write PNG charts there (needs matplotlib)")
    p.add_argument("--output", default=None, help="also write the table to this file")


def _run_compare(ns: argparse.Namespace) -> int:
    from bench.compare import compare_table, load_result

    results = [load_result(p) for p in ns.results]
    if ns.names and len(ns.names) != len(results):
        print(f"--names: {len(ns.names)} names for {len(results)} files", file=sys.stderr)
        return 2
    table = compare_table(results, ns.names)
    print(table)
    if ns.output:
        with open(ns.output, "w") as f:
            f.write(table + "\n")
    if ns.plot:
        _plot(results, ns.plot, ns.names)
    return 0


def add_bench_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `bench` subcommands to `parser` (the `jaxserve bench` parser)."""
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    _add_offline(sub)
    _add_serve(sub)
    _add_compare(sub)
    _add_embed(sub)
    return parser


def run_bench(ns: argparse.Namespace) -> int:
    """Dispatch a parsed `jaxserve bench ...` command line."""
    handlers = {"offline": _run_offline, "serve": _run_serve, "compare": _run_compare, "embed": _run_embed}
    if ns.bench_command is None:
        print("usage: jaxserve bench {" + ",".join(handlers) + "} ...", file=sys.stderr)
        return 2
    return handlers[ns.bench_command](ns)


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.cli`: the same as `jaxserve bench`."""
    parser = argparse.ArgumentParser(prog="jaxserve bench", description="jaxserve benchmarks")
    add_bench_args(parser)
    return run_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
