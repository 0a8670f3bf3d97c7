"""`jaxserve bench embed`: an embedding model's throughput, against HF transformers on the same inputs.

One engine with `runner="pooling"`. The texts are the workload's (the fixed chat prompts by default:
each chat's messages joined, or the random workload's raw prompts), each led by its number so that the
fixed workload's repeats (it cycles its prompts) share no cached page, tokenized with the model's
special tokens. For each batch size B, the first B texts are submitted at once and run to the end;
embeddings/s and prompt tokens/s are over the wall time from the first in to the last out, the median
of `repeats` runs. The prefix cache is emptied before every run, so no run reuses another's work; the
prompt tokens read from the cache are reported, and tokens/s counts only the tokens computed.

With `hf_peer`, transformers' backbone (`AutoModel`, float32, torch on the same CPU) embeds the same
token ids as sentence-transformers batches them: sorted by length, padded per batch of B, pooled with
the attention mask. The lowest cosine between the two systems' vectors is reported, so both are seen
to compute the same embeddings.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from bench.machine import machine_info
from bench.workloads import WorkloadSpec


@dataclass(frozen=True)
class EmbedConfig:
    """What `run_embed` measures."""

    batch_sizes: tuple[int, ...] = (1, 32, 256)
    workload: WorkloadSpec = WorkloadSpec(name="fixed")
    repeats: int = 3
    hf_peer: bool = False

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"batch sizes must be >= 1, got {self.batch_sizes}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.workload.name not in ("fixed", "random"):
            raise ValueError("the embedding benchmark embeds the fixed or the random workload's texts")


def _texts(spec: WorkloadSpec, tokenizer: Any, n: int) -> list[str]:
    requests = list(dataclasses.replace(spec, num_prompts=n).build(tokenizer))[:n]
    return [f"{i + 1}. " + ("\n".join(str(m["content"]) for m in r.messages) if r.is_chat else r.prompt)
            for i, r in enumerate(requests)]


def _embed_all(engine: Any, prompts: list[list[int]]) -> tuple[float, list[list[float]], int]:
    """(seconds, vectors in order, cached prompt tokens) of one run."""
    from jaxserve.pooling_params import PoolingParams

    engine.reset_prefix_cache()
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"e{i}", p, PoolingParams())
    out: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        out.update((o.request_id, o) for o in engine.step())
    seconds = time.perf_counter() - t0
    ordered = [out[f"e{i}"] for i in range(len(prompts))]
    return seconds, [o.outputs.embedding for o in ordered], sum(o.metrics.num_cached_tokens for o in ordered)


def _hf_peer(path: str, prompts: list[list[int]], batch: int, pooling: str, normalize: bool):
    """transformers' backbone on `prompts`, batched as sentence-transformers batches; (seconds, vectors)."""
    import torch
    import transformers

    if path.endswith(".gguf"):
        d, f = os.path.split(path)
        model = transformers.AutoModel.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    else:
        model = transformers.AutoModel.from_pretrained(path, dtype=torch.float32)
    model.eval()
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    vectors: list[Any] = [None] * len(prompts)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(order), batch):
            idx = order[start:start + batch]
            width = max(len(prompts[i]) for i in idx)
            ids = torch.zeros((len(idx), width), dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for r, i in enumerate(idx):
                ids[r, : len(prompts[i])] = torch.tensor(prompts[i])
                mask[r, : len(prompts[i])] = 1
            h = model(input_ids=ids, attention_mask=mask).last_hidden_state
            if pooling == "LAST":
                pooled = h[torch.arange(len(idx)), mask.sum(1) - 1]
            elif pooling == "CLS":
                pooled = h[:, 0]
            else:
                pooled = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
            if normalize:
                pooled = torch.nn.functional.normalize(pooled, dim=-1)
            for r, i in enumerate(idx):
                vectors[i] = pooled[r].numpy()
    return time.perf_counter() - t0, vectors


def _min_cosine(a: list, b: list) -> float:
    x, y = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.min(np.sum(x * y, 1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1))))


def run_embed(engine_args: Any, cfg: EmbedConfig, progress: bool = True, log=print) -> dict:
    """Run the embedding benchmark; returns the result document (see the module docstring)."""
    import jax

    from jaxserve.engine.llm_engine import LLMEngine

    engine_args = engine_args.replace(runner="pooling")
    engine = LLMEngine(engine_args, progress=progress)
    top = max(cfg.batch_sizes)
    prompts = [engine.tokenize_prompt(t, add_special_tokens=True)[-engine.max_model_len:]
               for t in _texts(cfg.workload, engine.tokenizer, top)]
    pc = engine.pooler_config
    log(f"engine ready: warmup {engine.warmup_seconds:.1f} s; {pc.pooling_type} pooling, {len(prompts)} texts")
    _embed_all(engine, prompts[:2])  # untimed: first-call costs stay out of the figures
    result: dict[str, Any] = {
        "kind": "embed", "system": "jaxserve", "machine": machine_info(), "device": jax.devices()[0].device_kind,
        "engine_args": dataclasses.asdict(engine_args),
        "settings": {**dataclasses.asdict(cfg), "workload": cfg.workload.to_dict()},
        "model": {"name": engine.model.name, "path": engine.model.path, "hidden_size": engine.hidden_size},
        "pooler": dataclasses.asdict(pc), "warmup_s": engine.warmup_seconds, "runs": [],
    }
    for b in cfg.batch_sizes:
        batch = prompts[:b]
        tokens = sum(len(p) for p in batch)
        times, cached = [], 0
        for _ in range(cfg.repeats):
            seconds, vectors, c = _embed_all(engine, batch)
            times.append(seconds)
            cached += c
        run: dict[str, Any] = {"batch": b, "prompt_tokens": tokens, "seconds": times,
                               "embeddings_per_s": b / statistics.median(times), "cached_tokens": cached,
                               "tokens_per_s": (tokens - cached / cfg.repeats) / statistics.median(times)}
        if cfg.hf_peer:
            peer = [_hf_peer(engine.model.path, batch, b, pc.pooling_type, pc.normalize) for _ in range(cfg.repeats)]
            run["hf_seconds"] = [s for s, _ in peer]
            run["hf_embeddings_per_s"] = b / statistics.median(run["hf_seconds"])
            run["min_cosine_vs_hf"] = _min_cosine(vectors, peer[-1][1])
        log(f"batch {b}: {run['embeddings_per_s']:.1f} embeddings/s, {run['tokens_per_s']:.0f} tokens/s")
        result["runs"].append(run)
    result["compilations_after_warmup"] = engine.stats().compilations_after_warmup
    return result


def format_report(result: dict) -> str:
    lines = [f"{result['model']['name']} as an embedding model ({result['pooler']['pooling_type']} pooling) "
             f"on {result['device']}; medians of {result['settings']['repeats']} runs"]
    peer = "hf_embeddings_per_s" in result["runs"][0]
    head = "| batch | prompt tokens | embeddings/s | tokens/s |"
    lines += [head + (" HF embeddings/s | ratio | min cosine |" if peer else ""),
              "|---" * (4 + 3 * peer) + "|"]
    for r in result["runs"]:
        row = f"| {r['batch']} | {r['prompt_tokens']} | {r['embeddings_per_s']:.1f} | {r['tokens_per_s']:.0f} |"
        if peer:
            row += (f" {r['hf_embeddings_per_s']:.1f} | {r['embeddings_per_s'] / r['hf_embeddings_per_s']:.2f}x |"
                    f" {r['min_cosine_vs_hf']:.6f} |")
        lines.append(row)
    lines.append(f"compilations after warmup: {result['compilations_after_warmup']}")
    return "\n".join(lines)
