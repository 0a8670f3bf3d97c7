"""`jaxserve bench offline | serve | compare`: the flags and the handlers."""

from __future__ import annotations

import argparse
import sys

from jaxserve.engine_args import EngineArgs


def _add_offline(sub) -> None:
    from bench.workloads import DEFAULT_PROMPTS

    p = sub.add_parser("offline", help="engine throughput, batch-1 decode against the bandwidth floor",
                       description="Offline benchmark of the engine on the fixed chat prompts: output tokens/s "
                                   "at each concurrency, batch-1 decode step time next to the memory-bandwidth "
                                   "floor, host share of step time, compilations after warmup.")
    EngineArgs.add_cli_args(p)
    # Every concurrency runs at once: the engine needs that many sequence slots.
    p.set_defaults(max_num_seqs=256)
    g = p.add_argument_group("benchmark")
    g.add_argument("--concurrency", type=int, nargs="+", default=[32, 256], help="requests sent at once, per run")
    g.add_argument("--output-len", type=int, default=128, help="tokens generated per request (EOS ignored)")
    g.add_argument("--dataset-path", default=str(DEFAULT_PROMPTS), help="JSONL of chat prompts")
    g.add_argument("--bandwidth-mib", type=int, default=512, help="buffer size of the bandwidth measurement")
    g.add_argument("--skip-batch1", action="store_true", help="leave out the batch-1 run (and the floor)")
    g.add_argument("--result-file", default=None, help="where to write the JSON (default bench/results/)")
    g.add_argument("--quiet", action="store_true", help="no progress bars")


def _run_offline(ns: argparse.Namespace) -> int:
    from bench.offline import OfflineConfig, format_report, run_offline, write_result

    args = EngineArgs.from_cli_args(ns)
    if args.max_num_seqs < max(ns.concurrency):
        print(f"note: max_num_seqs {args.max_num_seqs} < concurrency {max(ns.concurrency)}: "
              "the rest of the requests wait", file=sys.stderr)
    cfg = OfflineConfig(concurrency=tuple(ns.concurrency), output_len=ns.output_len, dataset_path=ns.dataset_path,
                        bandwidth_bytes=ns.bandwidth_mib << 20, skip_batch1=ns.skip_batch1)
    result = run_offline(args, cfg, progress=not ns.quiet,
                         log=lambda m: print(m, file=sys.stderr, flush=True))
    print(format_report(result))
    path = write_result(result, ns.result_file, "offline")
    print(f"wrote {path}")
    return 0


def add_bench_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `bench` subcommands to `parser` (the `jaxserve bench` parser)."""
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    _add_offline(sub)
    return parser


def run_bench(ns: argparse.Namespace) -> int:
    """Dispatch a parsed `jaxserve bench ...` command line."""
    handlers = {"offline": _run_offline}
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
