"""Small drivers of the model forward for tests (no engine): whole prompts, chunks, greedy loops."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.inputs import KVCache, ModelInputs
from jaxserve.models.llama import forward


@functools.cache
def jitted(backend: str = "xla"):
    return jax.jit(forward, static_argnums=(3, 4), static_argnames=("backend",), donate_argnums=(1,))


def pages_for(seq_index: int, num_tokens: int, page_size: int, stride: int = 64) -> list[int]:
    """Distinct, non-contiguous page ids for a sequence (never page 0)."""
    n = -(-num_tokens // page_size)
    return [1 + seq_index + stride * i for i in range(n)][::-1]


def run_chunks(cfg, params, kv, seqs, page_size, all_logits=True, backend="xla", **bucket):
    """One step over `(new_ids, start, pages)` per sequence; returns (logits as numpy, kv). A hybrid model's
    sequence i keeps its states in slot i + 1."""
    if cfg.mamba is not None:
        bucket = {"state_slots": list(range(1, len(seqs) + 1)), **bucket}
    inputs = ModelInputs.build(seqs, page_size, all_logits=all_logits, **bucket)
    logits, kv = jitted(backend)(params, kv, inputs, cfg, backend)
    return np.asarray(logits), kv


def bucket(n: int, step: int = 64) -> int:
    """Round a token count up so that prompts of similar length share one compiled shape."""
    return -(-n // step) * step


def prompt_logits(cfg, params, ids, page_size=16, num_pages=256, dtype=jnp.float32, backend="xla"):
    """Logits at every position of one prompt, computed in one step on a fresh page pool (a LongRoPE model's
    prompt past its original context on the long factors throughout, as transformers computes it)."""
    kv = KVCache.allocate(cfg, num_pages, page_size, dtype, state_slots=2)
    pages = pages_for(0, len(ids), page_size, stride=max(1, (num_pages - 1) // max(1, -(-len(ids) // page_size))))
    long = None if cfg.long_rope_context is None else [len(ids) > cfg.long_rope_context]
    logits, _ = run_chunks(cfg, params, kv, [(list(ids), 0, pages)], page_size, backend=backend,
                           num_tokens=bucket(len(ids)), num_seqs=1, pages_per_seq=bucket(len(pages), 16),
                           long_prompts=long)
    return logits[: len(ids)]


def greedy(cfg, params, ids, max_new, page_size=16, num_pages=64, dtype=jnp.float32):
    """Greedy continuation: one prefill step, then one decode step per token."""
    kv = KVCache.allocate(cfg, num_pages, page_size, dtype, state_slots=2)
    total = len(ids) + max_new
    pages = pages_for(0, total, page_size, stride=1)
    P = bucket(len(pages), 16)
    logits, kv = run_chunks(cfg, params, kv, [(list(ids), 0, pages)], page_size, all_logits=False,
                            num_tokens=bucket(len(ids)), num_seqs=1, pages_per_seq=P)
    out = [int(logits[0].argmax())]
    while len(out) < max_new:
        pos = len(ids) + len(out) - 1
        logits, kv = run_chunks(cfg, params, kv, [([out[-1]], pos, pages)], page_size, all_logits=False,
                                num_seqs=1, pages_per_seq=P)
        out.append(int(logits[0].argmax()))
    return out


def drain(engine) -> dict:
    """Step an engine until its requests are done; their final outputs by request id (its integrity checked)."""
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    engine.check_integrity()
    return final


def image_engine(path: str, **kw):
    """An engine over a tiny image-text model directory: float32, 32-token steps, no warmup."""
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine_args import EngineArgs

    args = EngineArgs(model=path, **{**dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=512, page_size=8,
                                            kv_cache_memory_bytes=2**21, dtype="float32", warmup=False,
                                            compile_cache_dir=None), **kw})
    return LLMEngine(args, progress=False)


def run_images(engine, prompts, images, ids=None, *, params) -> list[tuple[list[int], list[float]]]:
    """Each prompt with its images run to the end together: its tokens and their logprobs (`params` asks for them)."""
    ids = ids or [f"r{i}" for i in range(len(prompts))]
    for rid, prompt, ims in zip(ids, prompts, images, strict=True):
        engine.add_request(rid, prompt, params, multi_modal_data=ims if isinstance(ims, dict) else {"image": ims})
    final = drain(engine)
    out = []
    for rid in ids:
        c = final[rid].outputs[0]
        out.append((list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)]))
    return out


def assert_batched_then_cached(engine, prompts, media, expected, min_hits: int, *, params) -> None:
    """All prompts (with their images) in one batch, then each alone again: every run the `expected` greedy tokens
    and logprobs, the second time at least `min_hits` prompt tokens from the prefix cache; no page lost."""
    assert_same_greedy(run_images(engine, prompts, media, params=params), expected)
    hits = engine.scheduler.cache.hit_tokens
    again = [run_images(engine, [p], [m], [f"again{i}"], params=params)[0]
             for i, (p, m) in enumerate(zip(prompts, media, strict=True))]
    assert_same_greedy(again, expected)
    assert engine.scheduler.cache.hit_tokens - hits >= min_hits
    engine.check_integrity()


def torch_greedy(forward, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """A torch model's n greedy tokens after `ids` and their logprobs, a full forward per token (`forward(ids)`: the
    last position's logits)."""
    import torch

    out: list[int] = []
    lps: list[float] = []
    with torch.no_grad():
        for _ in range(n):
            logits = forward(ids + out)
            out.append(int(logits.argmax()))
            lps.append(float(torch.log_softmax(logits.double(), -1)[out[-1]]))
    return out, lps


def assert_same_greedy(got, expected, atol: float = 2e-4) -> None:
    """Runs' (tokens, logprobs) the expected ones: the same tokens, logprobs within `atol`."""
    assert len(got) == len(expected)
    for (tokens, lps), (want_tokens, want_lps) in zip(got, expected, strict=True):
        assert tokens == want_tokens
        np.testing.assert_allclose(lps, want_lps, atol=atol)


def tiny_engine(cfg, params, loop: str = "auto", prefix_caching: bool = False, backend: str = "auto"):
    """An engine over a tiny model's float32 `params`: 4 sequences, 16 tokens a step (prompts prefill in chunks), 24
    pages of 8 tokens, 4 decode steps a call; `loop`: its layers stacked ("scan") or unrolled."""
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine.model_loading import LoadedModel
    from jaxserve.engine_args import EngineArgs
    from tests.fake_model import fake_tokenizer

    loaded = LoadedModel("tiny", cfg.family, cfg, params, fake_tokenizer(), jnp.float32, 0.0)
    args = EngineArgs(attention_backend=backend, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
                      page_size=8, kv_cache_memory_bytes=24 * KVCache.bytes_per_page(cfg, 8, jnp.float32),
                      num_scheduler_steps=4, dtype="float32", warmup=False, compile_cache_dir=None, layer_loop=loop,
                      enable_prefix_caching=prefix_caching)
    return LLMEngine(args, loaded=loaded, progress=False)
