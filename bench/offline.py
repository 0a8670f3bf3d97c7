"""`jaxserve bench offline`: engine throughput and batch-1 decode against the memory-bandwidth floor.

On one engine, in one process:
- batch 1: one chat request, its decode step time (device time of the runner's decode loop per
  token) next to the floor: the bytes a decode step must read (the weights, and the KV of the context)
  divided by the memory bandwidth numpy reaches in the same run;
- for each concurrency N: the first N requests of the workload (the fixed chat prompts by default)
  added at once, their output lengths forced (EOS ignored), output tokens/s over the wall time from
  the first request in to the last out;
- the host share of each run: the part of engine.step wall time with no step on the device (dispatched
  and not yet fetched); with async scheduling a step is in flight while the host detokenizes;
- compilations after warmup (should be 0: every shape bucket compiles at warmup).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.machine import Bandwidth, machine_info, measure_bandwidth, measure_device_bandwidth
from bench.workloads import BenchRequest, WorkloadSpec

# The targets of the offline benchmark on a 2-core CPU (see the benchmark issue).
TARGET_FLOOR_RATIO = 1.5
TARGET_SPEEDUP_32 = 10.0
TARGET_HOST_SHARE = 0.10


@dataclass(frozen=True)
class OfflineConfig:
    """What `run_offline` measures."""

    concurrency: tuple[int, ...] = (32, 256)
    workload: WorkloadSpec = WorkloadSpec(name="fixed", output_len=128)  # num_prompts is set per run
    bandwidth_bytes: int = 512 << 20
    skip_batch1: bool = False
    json_schema: dict | None = None
    """When set, every concurrency run generates under this schema (structured outputs): a request
    ends when its JSON is whole, or at its output length."""
    lora_name: str | None = None
    """When set, every request runs through this LoRA adapter (one of the engine's `lora_modules`)."""

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency values must be >= 1, got {self.concurrency}")
        if self.workload.output_len < 2:
            raise ValueError(f"output_len must be >= 2, got {self.workload.output_len}")
        if self.workload.name == "multi-turn":
            raise ValueError("the offline benchmark runs single-turn workloads (random, fixed, shared-prefix)")


@dataclass
class _Call:
    kind: str  # "decode" or "mixed"
    seconds: float  # dispatch to outputs on the host: device work and the copy of the outputs
    steps: int  # decode steps run on the device in the call (1 for a mixed step)
    rows: int


class StepProbe:
    """Records each runner step of an engine (kind, dispatch-to-outputs time, decode steps), to split
    step time host/device."""

    def __init__(self, runner: Any):
        self.calls: list[_Call] = []
        fetch = runner.fetch

        def probed_fetch(step, *a, **k):
            out = fetch(step, *a, **k)
            steps = int(np.max(out.num_generated)) if step.kind == "decode" else 1
            self.calls.append(_Call(step.kind, runner.last_step_time, steps, step.rows))
            return out

        runner.fetch = probed_fetch

    def take(self) -> list[_Call]:
        calls, self.calls = self.calls, []
        return calls


@dataclass
class RunStats:
    """One batch of requests driven to completion."""

    num_requests: int
    prompt_tokens: int
    output_tokens: int
    wall_s: float
    step_wall_s: float = 0.0  # sum of engine.step wall times
    runner_s: float = 0.0  # sum of the runner calls' times
    decode_s: float = 0.0  # runner time of decode-only calls
    decode_steps: int = 0  # device decode steps in those calls
    decode_calls: int = 0
    mixed_calls: int = 0
    engine_steps: int = 0
    ttft_s: list[float] = field(default_factory=list)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def host_share(self) -> float:
        return max(0.0, 1.0 - self.runner_s / self.step_wall_s) if self.step_wall_s else float("nan")

    @property
    def decode_step_s(self) -> float:
        """Runner time per device decode step (all rows advance one token per step)."""
        return self.decode_s / self.decode_steps if self.decode_steps else float("nan")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("ttft_s")
        d.update(output_tok_s=self.output_tok_s, host_share=self.host_share, decode_step_s=self.decode_step_s,
                 mean_ttft_s=float(np.mean(self.ttft_s)) if self.ttft_s else None)
        return d


def drive(engine: Any, probe: StepProbe, prompts: Sequence[list[int]], params: Any, tag: str,
          lora: str | None = None) -> RunStats:
    """Add every prompt at once (with its own params when `params` is a sequence; through LoRA adapter
    `lora` when given) and step the engine until all finish, timing each step."""
    t0 = time.perf_counter()
    per = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
    if len(per) != len(prompts):
        raise ValueError(f"{len(per)} sampling params for {len(prompts)} prompts")
    for i, (ids, p) in enumerate(zip(prompts, per, strict=True)):
        engine.add_request(f"{tag}-{i}", ids, p, **({"lora_request": lora} if lora else {}))
    stats = RunStats(len(prompts), sum(len(p) for p in prompts), 0, 0.0)
    probe.take()
    seen: set[str] = set()
    while engine.has_unfinished_requests():
        s0 = time.perf_counter()
        outs = engine.step()
        s1 = time.perf_counter()
        stats.engine_steps += 1
        stats.step_wall_s += s1 - s0
        for c in probe.take():
            stats.runner_s += c.seconds
            if c.kind == "decode":
                stats.decode_calls += 1
                stats.decode_s += c.seconds
                stats.decode_steps += c.steps
            else:
                stats.mixed_calls += 1
        for out in outs:
            if out.request_id not in seen and out.outputs[0].token_ids:
                seen.add(out.request_id)
                stats.ttft_s.append(s1 - t0)
            if out.finished:
                stats.output_tokens += len(out.outputs[0].token_ids)
    stats.wall_s = time.perf_counter() - t0
    return stats


def decode_bytes_per_step(engine: Any, context_lens: Sequence[float]) -> tuple[int, float]:
    """(weight bytes, mean KV bytes) one decode step reads at batch 1, over the given context lengths.

    The weights are read once per step: every parameter, except an untied embedding table, of which a
    step reads one row. The KV read is K and V of every layer for every token of the context.
    """
    import jax

    from jaxserve.models.inputs import KVCache

    params = engine.model.params
    cfg = engine.model.config
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    if not cfg.tie_word_embeddings:
        weights -= params.embed.size * params.embed.dtype.itemsize
    per_token = KVCache.bytes_per_page(cfg, 1, engine.kv_dtype)
    return int(weights), float(np.mean(context_lens)) * per_token


def kv_budget_for(loaded: Any, args: Any, num_seqs: int, max_len: int) -> int:
    """KV bytes that hold `num_seqs` sequences of `max_len` tokens at once, with a little slack (and a hybrid
    model's Mamba states)."""
    from jaxserve.engine.hybrid import state_layout
    from jaxserve.engine.model_loading import resolve_kv_cache_dtype
    from jaxserve.models.inputs import KVCache

    pages_per_seq = -(-max_len // args.page_size) + 1
    per_page = KVCache.bytes_per_page(loaded.config, args.page_size, resolve_kv_cache_dtype(args, loaded.dtype))
    return int((num_seqs * pages_per_seq + 16) * per_page) + state_layout(loaded.config, args, loaded.dtype).bytes


def run_offline(engine_args: Any, cfg: OfflineConfig, progress: bool = True,
                log=print) -> dict:
    """Run the whole offline benchmark; returns the result document (see the module docstring)."""
    import jax

    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine.model_loading import enable_compile_cache, load_model
    from jaxserve.sampling_params import SamplingParams

    log("measuring memory bandwidth ...")
    # The floor is set by the memory the weights and the KV cache are read from: the host's on the CPU,
    # the accelerator's otherwise.
    bw = (measure_bandwidth(cfg.bandwidth_bytes) if jax.default_backend() == "cpu"
          else measure_device_bandwidth(max(cfg.bandwidth_bytes, 1 << 30)))
    enable_compile_cache(engine_args.compile_cache_dir)
    loaded = load_model(engine_args, progress=progress)
    top = max(cfg.concurrency)
    spec = dataclasses.replace(cfg.workload, num_prompts=top)
    if spec.name == "shared-prefix":
        groups = -(-top // spec.gsp_prompts_per_group)
        spec = dataclasses.replace(spec, gsp_num_groups=max(spec.gsp_num_groups, groups))
    requests: list[BenchRequest] = list(spec.build(loaded.tokenizer))[:top]
    if len(requests) < top:
        raise ValueError(f"the workload has {len(requests)} requests; the largest run needs {top}")
    longest = max(r.prompt_len + r.output_len for r in requests)
    changes: dict[str, Any] = {}
    if engine_args.kv_cache_memory_bytes is None:
        changes["kv_cache_memory_bytes"] = kv_budget_for(loaded, engine_args, top, longest)
    engine_args = engine_args.replace(**changes)
    t0 = time.perf_counter()
    engine = LLMEngine(engine_args, loaded=loaded, progress=progress)
    log(f"engine ready: warmup {engine.warmup_seconds:.1f} s ({time.perf_counter() - t0:.1f} s with setup)")
    probe = StepProbe(engine.runner)
    tok = engine.tokenizer
    prompts = [tok.encode_chat(list(r.messages)) if r.is_chat else tok.encode(r.prompt) for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]

    # A short untimed run: first-call costs (allocation, caches) stay out of the figures.
    drive(engine, probe, prompts[:2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), "warm")
    engine.reset_prefix_cache()

    result: dict[str, Any] = {
        "kind": "offline",
        "system": "jaxserve",
        "machine": machine_info(),
        "device": jax.devices()[0].device_kind,
        "engine_args": {k: v for k, v in dataclasses.asdict(engine_args).items()},
        "settings": {**dataclasses.asdict(cfg), "workload": spec.to_dict()},
        "bandwidth": bw.to_dict(),
        "model": {"name": loaded.name, "path": loaded.path, "dtype": str(np.dtype(loaded.dtype))},
        "warmup_s": engine.warmup_seconds,
        "runs": [],
    }
    batch1 = None
    if not cfg.skip_batch1:
        log("batch 1 ...")
        batch1 = drive(engine, probe, prompts[:1], params[:1], "b1", cfg.lora_name)
        engine.reset_prefix_cache()
        ctx = [len(prompts[0]) + i for i in range(1, requests[0].output_len)]
        w_bytes, kv_bytes = decode_bytes_per_step(engine, ctx)
        floor = (w_bytes + kv_bytes) / bw.best
        result["batch1"] = {**batch1.to_dict(), "weight_bytes": w_bytes, "kv_bytes_mean": kv_bytes,
                            "floor_step_s": floor, "floor_ratio": batch1.decode_step_s / floor}
    if cfg.json_schema is not None:
        from jaxserve.structured_outputs import StructuredOutputsParams

        constraint = StructuredOutputsParams(json=cfg.json_schema)
        params = [dataclasses.replace(p, structured_outputs=constraint) for p in params]
    for n in cfg.concurrency:
        log(f"{n} concurrent requests ...")
        stats = drive(engine, probe, prompts[:n], params[:n], f"c{n}", cfg.lora_name)
        engine.reset_prefix_cache()
        result["runs"].append({"concurrency": n, **stats.to_dict()})
    result["compilations_after_warmup"] = engine.stats().compilations_after_warmup
    result["num_preemptions"] = engine.num_preemptions
    st = engine.stats()
    if st.spec_num_draft_tokens:
        result["speculative"] = {"drafts": st.spec_num_drafts, "draft_tokens": st.spec_num_draft_tokens,
                                 "accepted_tokens": st.spec_num_accepted_tokens,
                                 "accepted_per_position": list(st.spec_num_accepted_tokens_per_pos)}
    result["targets"] = evaluate_targets(result)
    return result


def evaluate_targets(result: dict) -> dict[str, dict]:
    """Each target of the issue: its value, its limit, and whether it is met (None: not measured)."""
    out: dict[str, dict] = {}
    b1 = result.get("batch1")
    runs = {r["concurrency"]: r for r in result["runs"]}
    if b1:
        out["batch1_floor_ratio"] = {"value": b1["floor_ratio"], "limit": f"<= {TARGET_FLOOR_RATIO}",
                                     "met": b1["floor_ratio"] <= TARGET_FLOOR_RATIO}
    if b1 and 32 in runs:
        speedup = runs[32]["output_tok_s"] / b1["output_tok_s"]
        out["speedup_32_over_batch1"] = {"value": speedup, "limit": f">= {TARGET_SPEEDUP_32}",
                                         "met": speedup >= TARGET_SPEEDUP_32}
    if 32 in runs:
        share = runs[32]["host_share"]
        out["host_share_32"] = {"value": share, "limit": f"<= {TARGET_HOST_SHARE}", "met": share <= TARGET_HOST_SHARE}
    c = result["compilations_after_warmup"]
    out["compilations_after_warmup"] = {"value": c, "limit": "== 0", "met": c == 0}
    return out


def _bandwidth_line(bw: dict) -> str:
    if bw.get("memory", "host") != "host":
        return (f"{bw['memory']} memory bandwidth: read {bw['read_1thread'] / 1e9:.0f} GB/s, copy "
                f"{bw['copy_1thread'] / 1e9:.0f} GB/s (read+write); floor uses {bw['best'] / 1e9:.0f} GB/s")
    return (f"memory bandwidth: read {bw['read_1thread'] / 1e9:.1f} GB/s (1 thread), "
            f"{bw['read_all_threads'] / 1e9:.1f} GB/s ({bw['threads']} threads), copy {bw['copy_1thread'] / 1e9:.1f} "
            f"GB/s (read+write); floor uses {bw['best'] / 1e9:.1f} GB/s")


def format_report(result: dict) -> str:
    """The human-readable table of a result."""
    bw: dict = result["bandwidth"]
    lines = [
        f"model {result['model']['name']} ({result['model']['dtype']}), "
        f"{result['machine']['usable_cores']} cores: {result['machine']['cpu']}"
        + (f"; device {result['device']}" if result.get("bandwidth", {}).get("memory", "host") != "host" else ""),
        _bandwidth_line(bw),
        "",
        f"{'run':>12} {'reqs':>5} {'out tok':>8} {'wall s':>8} {'out tok/s':>10} {'decode step ms':>15} "
        f"{'host share':>11} {'mean TTFT s':>12}",
    ]

    def row(name: str, r: dict) -> str:
        ttft = r.get("mean_ttft_s")
        return (f"{name:>12} {r['num_requests']:>5} {r['output_tokens']:>8} {r['wall_s']:>8.2f} "
                f"{r['output_tok_s']:>10.1f} {r['decode_step_s'] * 1e3:>15.2f} {r['host_share'] * 100:>10.1f}% "
                f"{ttft if ttft is not None else float('nan'):>12.2f}")

    b1 = result.get("batch1")
    if b1:
        lines.append(row("batch 1", b1))
    for r in result["runs"]:
        lines.append(row(f"{r['concurrency']} conc.", r))
    if b1:
        lines += [
            "",
            f"batch-1 decode step {b1['decode_step_s'] * 1e3:.2f} ms; floor {b1['floor_step_s'] * 1e3:.2f} ms "
            f"= ({b1['weight_bytes'] / 1e6:.1f} MB weights + {b1['kv_bytes_mean'] / 1e6:.2f} MB KV) / "
            f"{bw['best'] / 1e9:.1f} GB/s; ratio {b1['floor_ratio']:.2f}",
        ]
    if result.get("settings", {}).get("json_schema") is not None:
        lines.append("concurrency runs under a JSON schema (structured outputs)")
    lines.append(f"compilations after warmup: {result['compilations_after_warmup']}; "
                 f"preemptions: {result['num_preemptions']}")
    if (spec := result.get("speculative")) is not None:
        lines.append(f"speculative decoding: {spec['accepted_tokens']} of {spec['draft_tokens']} draft tokens "
                     f"accepted, over {spec['drafts']} drafted request-steps")
    lines.append("")
    for name, t in result["targets"].items():
        v = t["value"]
        lines.append(f"target {name}: {v:.3g} (want {t['limit']}) {'met' if t['met'] else 'NOT met'}")
    return "\n".join(lines)


def write_result(result: dict, path: str | Path | None, prefix: str) -> Path:
    """Write `result` as JSON to `path` (default: bench/results/{prefix}-{time}.json); returns the path."""
    if path is None:
        path = Path("bench") / "results" / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=_json_default))
    return path


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.integer, np.floating)):
        return o.item()
    if isinstance(o, Bandwidth):
        return o.to_dict()
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)
