"""Compile every kernel for an H200 (sm_90) through a deviceless topology: lowering, XLA:GPU and PTX."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import AttentionTuning, ragged_paged_attention, write_kv, write_kv_triton

pytestmark = pytest.mark.gpu_compile


def _compile(fn, *args):
    compiled = jax.jit(fn).trace(*args).lower().compile()
    text = compiled.as_text()
    assert text, "empty compiled module"
    return text


def _attention_args(spec, T, S, P, ps, kvh, group, d, dtype, num_pages=2048, kv_dtype=None):
    kv_dtype = kv_dtype or dtype
    return (
        spec((T, kvh * group, d), dtype),
        spec((num_pages, ps, kvh, d), kv_dtype),
        spec((num_pages, ps, kvh, d), kv_dtype),
        spec((S, P), jnp.int32),
        spec((S,), jnp.int32),
        spec((S + 1,), jnp.int32),
    )


# Shapes of the served models: SmolLM2 (9q/3kv/64) and Llama-3-8B (32q/8kv/128); decode buckets, one long
# decode (KV splits), prefill chunks; every kernel path (tiny rows, padded rows, MMA, splits, cap, window).
ATTENTION_CASES = [
    # T, S, P, page_size, kv_heads, group, head_dim, dtype, tuning, extras
    (32, 32, 64, 16, 3, 3, 64, jnp.bfloat16, AttentionTuning(), {}),
    (256, 256, 512, 16, 8, 4, 128, jnp.bfloat16, AttentionTuning(), {}),
    (1, 1, 2048, 16, 8, 4, 128, jnp.bfloat16, AttentionTuning(), {}),
    (2048, 1, 128, 16, 8, 4, 128, jnp.bfloat16, AttentionTuning(), {}),
    (512, 4, 64, 16, 3, 3, 64, jnp.bfloat16, AttentionTuning(), {"sliding_window": 256, "soft_cap": 30.0}),
    (64, 64, 32, 8, 3, 3, 64, jnp.float32, AttentionTuning(pad_rows_to_mma=True), {}),
    (128, 8, 16, 32, 8, 4, 128, jnp.float32, AttentionTuning(block_q=32, block_kv=64, num_kv_splits=4), {}),
    # Heads that are no power of two, read in power-of-two parts: Phi-3-mini's decode (32 x 96), MiMo-V2-Flash's
    # windowed prefill (64 heads over 8, 192 wide) and long decode (KV splits).
    (32, 32, 256, 16, 32, 1, 96, jnp.bfloat16, AttentionTuning(), {}),
    (2048, 1, 128, 16, 8, 8, 192, jnp.bfloat16, AttentionTuning(), {"sliding_window": 128}),
    (1, 1, 2048, 16, 8, 8, 192, jnp.bfloat16, AttentionTuning(), {}),
]


@pytest.mark.parametrize("T,S,P,ps,kvh,group,d,dtype,tuning,extras", ATTENTION_CASES)
def test_attention_compiles_for_sm90(spec, T, S, P, ps, kvh, group, d, dtype, tuning, extras):
    fn = functools.partial(ragged_paged_attention, sm_scale=d**-0.5, tuning=tuning, **extras)
    text = _compile(fn, *_attention_args(spec, T, S, P, ps, kvh, group, d, dtype))
    assert "triton" in text.lower(), "the attention did not go through the Triton lowering"


# Float8 pages under bfloat16 queries (`--kv-cache-dtype fp8` / `fp8_e5m2`): decode batches of both models, a
# long decode with KV splits, a prefill chunk, and float32 queries on the non-MMA path.
FP8_CASES = [
    (64, 64, 512, 16, 3, 3, 64, jnp.bfloat16, jnp.float8_e4m3fn),
    (256, 256, 512, 16, 8, 4, 128, jnp.bfloat16, jnp.float8_e4m3fn),
    (1, 1, 2048, 16, 8, 4, 128, jnp.bfloat16, jnp.float8_e5m2),
    (2048, 1, 128, 16, 8, 4, 128, jnp.bfloat16, jnp.float8_e4m3fn),
    (32, 32, 64, 16, 3, 1, 64, jnp.float32, jnp.float8_e5m2),
]


@pytest.mark.parametrize("T,S,P,ps,kvh,group,d,dtype,kv_dtype", FP8_CASES)
def test_fp8_kv_attention_compiles_for_sm90(spec, T, S, P, ps, kvh, group, d, dtype, kv_dtype):
    fn = functools.partial(ragged_paged_attention, sm_scale=d**-0.5)
    text = _compile(fn, *_attention_args(spec, T, S, P, ps, kvh, group, d, dtype, kv_dtype=kv_dtype))
    assert "triton" in text.lower(), "the attention did not go through the Triton lowering"


@pytest.mark.parametrize(
    "kvh,d,dtype", [(3, 64, jnp.bfloat16), (8, 128, jnp.bfloat16), (8, 128, jnp.float32), (8, 128, jnp.float8_e4m3fn)]
)
def test_write_kv_compiles_for_sm90(spec, kvh, d, dtype):
    pages = spec((2048, 16, kvh, d), dtype)
    new = spec((256, kvh, d), dtype)
    slots = spec((256,), jnp.int32)
    _compile(write_kv, pages, pages, new, new, slots)
    # jax_triton would ask a driver for the compute capability; there is none, so name sm_90.
    _compile(functools.partial(write_kv_triton, compute_capability=90), pages, pages, new, new, slots)


# Spans attended both ways (`last_key`: Gemma 3's images) in a 2k-token prefill of SmolLM2's heads: the generic
# kernel (a vector of row ends) and the ragged Mosaic GPU kernel's one-warpgroup form (spans in each block's
# metadata, the generic kernel behind a cond for a block that meets more than two). Gemma 3's own heads, on the
# warp-specialized form, are compiled in its engine step (test_compile_gemma.py).
@pytest.mark.parametrize("kvh,group,d,window,lowering,compute_wgs", [
    (3, 3, 64, 256, "triton", None), (3, 3, 64, None, "mosaic", 1),
])
def test_span_attention_compiles_for_sm90(spec, kvh, group, d, window, lowering, compute_wgs):
    from pallas_kernels.ragged_attention_mosaic import ragged_paged_attention_mosaic

    T, S = 2048, 2
    args = (*_attention_args(spec, T, S, 256, 16, kvh, group, d, jnp.bfloat16), spec((T,), jnp.int32))
    if lowering == "triton":
        def fn(*a):
            return ragged_paged_attention(*a[:6], sm_scale=d**-0.5, sliding_window=window, last_key=a[6])
    else:
        def fn(*a):
            return ragged_paged_attention_mosaic(*a[:6], sm_scale=d**-0.5, sliding_window=window, last_key=a[6],
                                                 compute_wgs=compute_wgs)
    text = _compile(fn, *args)
    if lowering == "mosaic":
        assert 'custom_call_target="mosaic_gpu' in text, "no Mosaic GPU kernel in the compiled function"
    assert "triton" in text.lower(), "no generic kernel (the spans' fallback) in the compiled function"


# gpt-oss's attention sinks on its heads (64 q / 8 kv, 64 wide; every other layer windowed at 128): a decode bucket,
# one long decode (KV splits: the sinks join in the combine), a windowed prefill chunk; with the Mosaic GPU
# lowerings asked for, decode batches go to the Mosaic decode kernel and batches with chunks to the
# warp-specialized ragged one (each row's sink joins its sum at the end), none to the generic kernel.
@pytest.mark.parametrize("T,S,P,window,tuning", [
    (64, 64, 512, None, AttentionTuning()),
    (1, 1, 2048, None, AttentionTuning()),
    (2048, 1, 128, 128, AttentionTuning()),
    (256, 256, 512, 128, AttentionTuning(decode_lowering="mosaic", prefill_lowering="mosaic")),
])
def test_sink_attention_compiles_for_sm90(spec, T, S, P, window, tuning):
    args = (*_attention_args(spec, T, S, P, 16, 8, 8, 64, jnp.bfloat16), spec((64,), jnp.float32))

    def fn(*a):
        return ragged_paged_attention(*a[:6], sm_scale=0.125, sliding_window=window, sinks=a[6], tuning=tuning)

    text = _compile(fn, *args)
    mosaic = tuning.decode_lowering == "mosaic"
    assert ('custom_call_target="mosaic_gpu' in text) is mosaic
    assert ("triton" in text.lower()) is not mosaic


# ALiBi on Falcon-RW-7B's heads (71 q, 71 kv, 64 wide): a decode bucket, one long decode (KV splits) and a prefill
# chunk; with the Mosaic GPU lowerings asked for, all on the generic kernel (the Mosaic ones take no slopes).
@pytest.mark.parametrize("T,S,P,tuning", [
    (64, 64, 128, AttentionTuning()),
    (1, 1, 2048, AttentionTuning()),
    (512, 2, 128, AttentionTuning(decode_lowering="mosaic", prefill_lowering="mosaic")),
])
def test_alibi_attention_compiles_for_sm90(spec, T, S, P, tuning):
    args = (*_attention_args(spec, T, S, P, 16, 71, 1, 64, jnp.bfloat16), spec((71,), jnp.float32))

    def fn(*a):
        return ragged_paged_attention(*a[:6], sm_scale=0.125, alibi=a[6], tuning=tuning)

    text = _compile(fn, *args)
    assert 'custom_call_target="mosaic_gpu' not in text and "triton" in text.lower()


# The ragged Mosaic GPU kernel's other forms with sinks: one warpgroup with its walk split (the sinks join in the
# partials' combine), and the warp-specialized form over float8 pages (upcast by the loading warpgroup).
@pytest.mark.parametrize("compute_wgs,num_splits,kv_dtype", [(1, 2, jnp.bfloat16), (2, None, jnp.float8_e4m3fn)])
def test_sink_ragged_mosaic_forms_compile_for_sm90(spec, compute_wgs, num_splits, kv_dtype):
    from pallas_kernels.ragged_attention_mosaic import ragged_paged_attention_mosaic

    args = (*_attention_args(spec, 512, 4, 128, 16, 8, 8, 64, jnp.bfloat16, kv_dtype=kv_dtype),
            spec((64,), jnp.float32))

    def fn(*a):
        return ragged_paged_attention_mosaic(*a[:6], sm_scale=0.125, sliding_window=128, sinks=a[6],
                                             compute_wgs=compute_wgs, num_splits=num_splits)

    assert 'custom_call_target="mosaic_gpu' in _compile(fn, *args)


# Llama 4's chunked attention on its heads (40 q / 8 kv, 128 wide; chunks of 8192 positions) over 16k contexts: a
# decode bucket and a 2k-token prefill chunk on the generic kernel, then with the Mosaic GPU lowerings asked for
# (decode batches on the decode kernel; chunks on the warp-specialized ragged one), and the ragged kernel's
# one-warpgroup form with its walk split.
@pytest.mark.parametrize("T,S,tuning,compute_wgs", [
    (64, 64, AttentionTuning(), None),
    (2048, 1, AttentionTuning(), None),
    (64, 64, AttentionTuning(decode_lowering="mosaic", prefill_lowering="mosaic"), None),
    (2048, 1, AttentionTuning(decode_lowering="mosaic", prefill_lowering="mosaic"), None),
    (512, 4, None, 1),
])
def test_chunked_attention_compiles_for_sm90(spec, T, S, tuning, compute_wgs):
    from pallas_kernels.ragged_attention_mosaic import ragged_paged_attention_mosaic

    args = _attention_args(spec, T, S, 1024, 16, 8, 5, 128, jnp.bfloat16, num_pages=8192)
    if tuning is None:
        fn = functools.partial(ragged_paged_attention_mosaic, sm_scale=128**-0.5, attention_chunk=8192,
                               compute_wgs=compute_wgs, num_splits=2)
    else:
        fn = functools.partial(ragged_paged_attention, sm_scale=128**-0.5, attention_chunk=8192, tuning=tuning)
    text = _compile(fn, *args)
    mosaic = tuning is None or tuning.decode_lowering == "mosaic"
    assert ('custom_call_target="mosaic_gpu' in text) is mosaic
    assert ("triton" in text.lower()) is not mosaic


# DeepSeek Sparse Attention's attention step at DeepSeek-V3.2's shapes (128 heads over one 704-wide entry a token: a
# 512-dim latent, a 64-dim rotary key, the indexer's 128-dim key; the top 2048 entries a token): a decode bucket of
# 64 tokens (flash-decoding splits) and a 2k-token prefill, over bfloat16 and float8 pages.
@pytest.mark.parametrize("T,kv_dtype", [(64, jnp.bfloat16), (2048, jnp.bfloat16), (64, jnp.float8_e4m3fn)])
def test_sparse_latent_attention_compiles_for_sm90(spec, T, kv_dtype):
    from pallas_kernels.sparse_latent_attention import sparse_latent_attention

    fn = functools.partial(sparse_latent_attention, key_dim=576, value_dim=512, sm_scale=0.1)
    text = _compile(fn, spec((T, 128, 576), jnp.bfloat16), spec((8192, 64, 704), kv_dtype),
                    spec((1, T, 2048), jnp.int32), spec((T,), jnp.int32))
    assert "triton" in text.lower(), "the attention did not go through the Triton lowering"


# DeepSeek Sparse Attention's indexer scores at DeepSeek-V3.2's shapes (64 heads of 128 dims; the key at dims 576..704
# of the entry): a decode bucket of 64 tokens over 32k contexts, a 2k-token prefill over a 160k context (its scores
# 1.3 GB), bfloat16 and float8 pages; GLM-5's 32 heads.
@pytest.mark.parametrize("T,S,P,heads,kv_dtype", [(64, 64, 512, 64, jnp.bfloat16), (2048, 1, 2560, 64, jnp.bfloat16),
                                                  (64, 64, 512, 64, jnp.float8_e4m3fn), (64, 64, 512, 32, jnp.bfloat16)])
def test_index_scores_compile_for_sm90(spec, T, S, P, heads, kv_dtype):
    from pallas_kernels.sparse_index import index_scores

    fn = functools.partial(index_scores, key_offset=576, scale=128 ** -0.5)
    text = _compile(fn, spec((T, heads, 128), jnp.bfloat16), spec((T, heads), jnp.float32),
                    spec((8192, 64, 704), kv_dtype), spec((S, P), jnp.int32), spec((T,), jnp.int32),
                    spec((T,), jnp.int32))
    assert "triton" in text.lower(), "the indexer did not go through the Triton lowering"
