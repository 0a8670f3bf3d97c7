"""KV caches stored narrower than the model (`--kv-cache-dtype fp8 | fp8_e5m2 | bfloat16`).

The pages hold float8 (or bfloat16) values; every backend upcasts what it reads, so the attention of a
float8 cache is the attention of its upcast values. Checked here: the saturating quantization, the kernels
in interpret mode and the engine's CPU attention against the reference on float8 pages, the reference
against a float64 oracle of the upcast pages, the real model's logits next to its float32 cache, and an
engine on a float8 cache (its capacity, batched against alone, prefix hit against miss).
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.model_loading import LoadedModel, resolve_kv_cache_dtype
from jaxserve.engine_args import EngineArgs
from jaxserve.models.inputs import KVCache
from jaxserve.sampling_params import SamplingParams
from pallas_kernels import AttentionTuning, ragged_paged_attention, ragged_paged_attention_reference
from pallas_kernels.ragged_attention_args import quantize_kv
from tests.fake_model import fake_tokenizer
from tests.test_engine_pallas import CFG, numpy_params
from tests.test_kernels_cases import make_batch, naive_attention, standard_seqs

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _with_pages(batch, dtype):
    """The batch with its pages stored in `dtype` (page 0 keeps its NaN poison: both float8 formats have NaN)."""
    return dataclasses.replace(batch, k_pages=quantize_kv(batch.k_pages, dtype),
                               v_pages=quantize_kv(batch.v_pages, dtype))


def _args(batch):
    return (batch.q, batch.k_pages, batch.v_pages, batch.block_tables, batch.seq_lens, batch.query_start_loc)


def test_quantize_saturates_instead_of_nan():
    x = jnp.asarray([0.0, 1.0, -2.5, 447.0, 1000.0, -1e6, 3.0e4, 0.3], jnp.float32)
    e4 = np.asarray(quantize_kv(x, E4M3).astype(jnp.float32))
    assert np.isfinite(e4).all()
    np.testing.assert_array_equal(e4[:6], [0.0, 1.0, -2.5, 448.0, 448.0, -448.0])  # 447 rounds to 448
    assert abs(e4[7] - 0.3) <= 0.3 / 16  # 3 mantissa bits
    e5 = np.asarray(quantize_kv(x, E5M2).astype(jnp.float32))
    assert np.isfinite(e5).all() and e5[4] == 1024.0 and e5[5] == -57344.0 and e5[6] == 28672.0
    # A plain cast is what the saturation guards against.
    assert np.isnan(np.asarray(x[4:5].astype(E4M3).astype(jnp.float32))).all()
    np.testing.assert_array_equal(np.asarray(quantize_kv(x, jnp.bfloat16)), np.asarray(x.astype(jnp.bfloat16)))
    assert quantize_kv(x, jnp.float32) is x


# q dtype, page dtype, GQA group, tuning: the MMA path (bfloat16 queries, padded rows), KV splits, the
# non-MMA path (float32 queries), bfloat16 pages under float32 queries.
KERNEL_CASES = [
    (jnp.bfloat16, E4M3, 4, AttentionTuning()),
    (jnp.bfloat16, E4M3, 8, AttentionTuning(block_q=2, num_kv_splits=2)),
    (jnp.bfloat16, E5M2, 1, AttentionTuning(block_q=1, pad_rows_to_mma=True, block_kv=16)),
    (jnp.float32, E5M2, 3, AttentionTuning()),
    (jnp.float32, jnp.bfloat16, 3, AttentionTuning(block_q=4, num_kv_splits=4, block_kv=16)),
]


@pytest.mark.parametrize("q_dtype,kv_dtype,group,tuning", KERNEL_CASES)
def test_kernel_matches_reference_on_narrow_pages(q_dtype, kv_dtype, group, tuning):
    rng = np.random.default_rng(group * 7 + len(str(kv_dtype)))
    batch = _with_pages(make_batch(rng, page_size=16, head_dim=64, group=group, num_kv_heads=2, dtype=q_dtype,
                                   seqs=standard_seqs(16, 4), pages_per_seq=4), kv_dtype)
    ref = ragged_paged_attention_reference(*_args(batch), sm_scale=0.125)
    out = ragged_paged_attention(*_args(batch), sm_scale=0.125, interpret=jax.default_backend() == "cpu",
                                 tuning=tuning)
    assert out.dtype == q_dtype
    out, ref = np.asarray(out.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32))
    assert np.isfinite(out).all(), "non-finite output (unwritten tile or NaN from the scratch page)"
    n = batch.num_real_tokens
    tol = 3e-2 if q_dtype == jnp.bfloat16 else 2e-5
    np.testing.assert_allclose(out[:n], ref[:n], atol=tol, rtol=tol)


@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
def test_reference_on_float8_pages_is_attention_of_their_values(kv_dtype):
    """Float8 pages read back as exactly their values: the reference equals a float64 oracle over the
    upcast pages, and differs from the oracle over the unquantized ones by the quantization alone."""
    rng = np.random.default_rng(21)
    exact = make_batch(rng, page_size=8, head_dim=16, group=2, num_kv_heads=2, dtype=jnp.float32,
                       seqs=standard_seqs(8, 4), pages_per_seq=4)
    narrow = _with_pages(exact, kv_dtype)
    upcast = dataclasses.replace(narrow, k_pages=narrow.k_pages.astype(jnp.float32),
                                 v_pages=narrow.v_pages.astype(jnp.float32))
    ref = np.asarray(ragged_paged_attention_reference(*_args(narrow), sm_scale=0.3))
    n = exact.num_real_tokens
    np.testing.assert_allclose(ref[:n], naive_attention(upcast, sm_scale=0.3)[:n], atol=2e-5, rtol=2e-5)
    err = np.abs(ref[:n] - naive_attention(exact, sm_scale=0.3)[:n]).max()
    assert 1e-3 < err < (0.2 if kv_dtype == E4M3 else 0.4), err


@pytest.mark.parametrize("decode", [True, False])
def test_engine_cpu_attention_on_float8_pages(decode):
    from jaxserve.models.attention import xla_ragged_paged_attention

    rng = np.random.default_rng(22)
    seqs = [(1, 37), (1, 20), (1, 1), (1, 9)] if decode else [(1, 37), (9, 20), (1, 1), (13, 16)]
    batch = _with_pages(make_batch(rng, page_size=8, head_dim=16, group=3, num_kv_heads=2, dtype=jnp.float32,
                                   seqs=seqs, pages_per_seq=6), E4M3)
    ref = np.asarray(ragged_paged_attention_reference(*_args(batch), sm_scale=0.3))
    got = np.asarray(jax.jit(functools.partial(xla_ragged_paged_attention, sm_scale=0.3, decode=decode))(
        *_args(batch)))
    n = batch.num_real_tokens
    np.testing.assert_allclose(got[:n], ref[:n], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, E4M3])
@pytest.mark.parametrize("decode", [True, False])
def test_cpu_step_never_converts_the_whole_pool(kv_dtype, decode):
    """XLA:CPU has no bfloat16 or float8 gather or scatter and would upcast the whole pool of every layer
    around one (a step 20-70x slower, growing with the pool). Kept as raw bits, the merged pool
    `[layers * pages, page_size, Hkv, D]` appears in the compiled step in its integer type only."""
    from jaxserve.models.inputs import ModelInputs
    from tests.modelrun import jitted

    kv = KVCache.allocate(CFG, 300, 8, kv_dtype, as_bits=True)
    assert kv.dtype == jnp.dtype(kv_dtype) and kv.k.dtype.kind == "u"
    seqs = [([3], 35, [1, 2, 3, 4, 5]), ([4], 20, [6, 7, 8])] if decode else [([3] * 9, 30, [1, 2, 3, 4, 5])]
    inputs = dataclasses.replace(ModelInputs.build(seqs, 8, num_seqs=2, pages_per_seq=8), decode=decode)
    params = numpy_params(CFG, seed=1, scale=0.1)
    text = jitted("xla").lower(params, kv, inputs, CFG, "xla").compile().as_text()
    pool = f"[{CFG.num_layers * 300},8,{CFG.num_kv_heads},{CFG.head_dim}]"
    types = set(re.findall(r"(\w+)" + re.escape(pool), text))
    assert types == {f"u{8 * jnp.dtype(kv_dtype).itemsize}"}, types


def test_model_writes_saturated_float8():
    from jaxserve.models.kv_pages import write_kv

    pages = jnp.zeros((3, 4, 1, 2), E4M3)
    k = jnp.asarray([[[1.0, 600.0]], [[-0.5, -1e5]]], jnp.float32)
    k_pages, v_pages = write_kv(pages, pages, k, -k, jnp.asarray([5, 9], jnp.int32))
    assert k_pages.dtype == E4M3
    got = np.asarray(k_pages.astype(jnp.float32)).reshape(12, 2)
    np.testing.assert_array_equal(got[[5, 9]], [[1.0, 448.0], [-0.5, -448.0]])
    np.testing.assert_array_equal(np.asarray(v_pages.astype(jnp.float32)).reshape(12, 2)[5], [-1.0, -448.0])
    assert np.count_nonzero(got) == 4


def test_narrow_page_dtypes_are_named_in_errors():
    q = jnp.zeros((4, 4, 16), jnp.float32)
    pages = jnp.zeros((3, 8, 2, 16), jnp.int8)
    rest = (jnp.zeros((2, 2), jnp.int32), jnp.zeros((2,), jnp.int32), jnp.zeros((3,), jnp.int32))
    with pytest.raises(TypeError, match="k_pages dtype int8 cannot serve q"):
        ragged_paged_attention_reference(q, pages, pages, *rest, sm_scale=0.1)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, bfloat16, fp8"):
        EngineArgs(kv_cache_dtype="int8")
    assert resolve_kv_cache_dtype(EngineArgs(kv_cache_dtype="fp8"), jnp.bfloat16) == jnp.dtype(E4M3)
    assert resolve_kv_cache_dtype(EngineArgs(kv_cache_dtype="fp8_e5m2"), jnp.bfloat16) == jnp.dtype(E5M2)
    assert resolve_kv_cache_dtype(EngineArgs(), jnp.bfloat16) == jnp.dtype(jnp.bfloat16)


def test_cli_flag():
    import argparse

    ns = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(["--kv-cache-dtype", "fp8_e4m3"])
    assert EngineArgs.from_cli_args(ns).kv_cache_dtype == "fp8_e4m3"


@pytest.mark.slow
def test_real_model_logits_next_to_float32_cache(smollm_f32):
    """SmolLM2's next-token distributions over chat prompts whose every attention reads the narrow cache.
    Measured: bfloat16 mean KL ~1e-4 (96-100% of argmaxes kept); float8_e4m3fn mean KL 0.006-0.016 (85-97%
    kept); float8_e5m2 (2 mantissa bits) mean KL 0.04-0.09."""
    from jaxserve.loader import bundled_model_path
    from jaxserve.tokenizer import Tokenizer
    from tests.conftest import CHAT_PROMPTS
    from tests.modelrun import prompt_logits

    cfg, params = smollm_f32
    tok = Tokenizer.from_gguf(bundled_model_path())
    bounds = {jnp.bfloat16: (1e-3, 0.95), E4M3: (0.04, 0.8), E5M2: (0.15, 0.75)}
    for conv in CHAT_PROMPTS[1:3]:
        ids = tok.encode_chat(conv)
        ref = jax.nn.log_softmax(prompt_logits(cfg, params, ids))
        for dtype, (max_kl, min_agree) in bounds.items():
            got = jax.nn.log_softmax(prompt_logits(cfg, params, ids, dtype=dtype))
            kl = float(np.mean(np.sum(np.exp(ref) * (ref - got), axis=-1)))
            agree = float(np.mean(np.argmax(ref, -1) == np.argmax(got, -1)))
            assert kl < max_kl and agree >= min_agree, (jnp.dtype(dtype).name, kl, agree)
            if dtype != jnp.bfloat16:
                assert kl > 1e-3, "float8 pages changed nothing: the cache is not float8"


# ----------------------------------------------------------------------------------------------------------
# An engine on a float8 cache (the tiny random Llama of test_engine_pallas.py)

PAGE_SIZE = 8
BUDGET = 40 * KVCache.bytes_per_page(CFG, PAGE_SIZE, jnp.float32)
ARGS = EngineArgs(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=96, page_size=PAGE_SIZE,
                  kv_cache_memory_bytes=BUDGET, num_scheduler_steps=4, dtype="float32", warmup=False,
                  compile_cache_dir=None, kv_cache_dtype="fp8")


@pytest.fixture(scope="module")
def fp8_engine() -> LLMEngine:
    loaded = LoadedModel("tiny", "tiny-llama", CFG, numpy_params(CFG, seed=3, scale=0.3), fake_tokenizer(),
                         jnp.float32, 0.0)
    return LLMEngine(ARGS, loaded=loaded, progress=False)


def _run(engine: LLMEngine, prompts: dict[str, list[int]], max_tokens: int = 8) -> dict[str, list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    engine.check_integrity()
    return done


def test_fp8_engine_capacity_batching_and_prefix_cache(fp8_engine):
    engine = fp8_engine
    kv = engine.runner.kv
    assert engine.kv_dtype == jnp.dtype(E4M3) and kv.dtype == jnp.dtype(E4M3)
    assert kv.k.dtype == jnp.uint8  # the CPU attention's storage: the raw bits
    assert engine.stats().kv_cache_dtype == "fp8"  # /metrics: vllm:cache_config_info{cache_dtype="fp8"}
    # One byte an element where the model's float32 takes four: four times the pages from the same budget.
    assert engine.scheduler.pool.num_pages == 4 * 40
    rng = np.random.default_rng(5)
    shared = rng.integers(2, CFG.vocab_size, 24).tolist()
    prompts = {f"r{i}": shared[: 8 + 4 * i] + rng.integers(2, CFG.vocab_size, 3 + i).tolist() for i in range(4)}
    # Alone, in turn: each later request finds the earlier ones' shared pages in the prefix cache.
    hits0 = engine.scheduler.cache.hit_tokens
    alone = {rid: _run(engine, {rid: p})[rid] for rid, p in prompts.items()}
    assert engine.scheduler.cache.hit_tokens - hits0 >= 3 * 8
    misses = {}
    for rid, p in prompts.items():  # every one computed from scratch
        assert engine.reset_prefix_cache()
        misses[rid] = _run(engine, {rid: p})[rid]
    assert misses == alone
    assert engine.reset_prefix_cache()
    assert _run(engine, prompts) == alone  # all four in one batch
