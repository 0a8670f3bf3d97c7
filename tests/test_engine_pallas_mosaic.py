"""The Mosaic GPU decode kernel in Mosaic GPU's CPU interpreter against the float64 oracle, its dispatch from
`ragged_paged_attention` (decode batches to Mosaic GPU, anything else to the generic kernel), and its refusals.

The interpreter simulates SMEM, the TMA page copies and the barriers, but runs the two products as plain dots
(its WGMMA takes no transposed or register operand); the WGMMA path itself is compiled for sm_90 in
tests/gpu_compile and run on the GPU by bench/gpu_check.sh. On a GPU these tests run the compiled kernel.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import AttentionTuning, ragged_paged_attention
from pallas_kernels.paged_decode_mosaic import (
    mosaic_decode_supported,
    paged_decode_attention_mosaic,
    partial_dtype,
    smem_bytes,
)
from pallas_kernels.ragged_attention_args import quantize_kv
from tests.test_kernels_cases import make_batch, naive_attention

TOL = 3e-2  # bfloat16 inputs and probabilities


def _interpret() -> bool:
    return jax.default_backend() == "cpu"


def _check(out, batch, sm_scale, **scores):
    ref = naive_attention(batch, sm_scale=sm_scale, **scores)
    out = np.asarray(out.astype(jnp.float32))
    n = batch.num_real_tokens
    assert np.isfinite(out[:n]).all(), "non-finite output: a scratch-page row reached the products"
    np.testing.assert_allclose(out[:n], ref[:n], atol=TOL, rtol=TOL)


@pytest.mark.parametrize(
    "page_size,head_dim,group,kv_heads,kv_lens,splits,kv_dtype,stages",
    [
        # SmolLM2 heads; lengths at, just past and short of a 64-token block and of a page; one block and many.
        (16, 64, 3, 3, [64, 65, 15, 130], 1, jnp.bfloat16, 2),
        # Llama-3-8B heads, 8-token pages (8 copies per block), flash-decoding splits including empty ones.
        (8, 128, 4, 2, [200, 1, 64], 4, jnp.bfloat16, 2),
        # A ring of 4 stages: 3 blocks in flight, fewer blocks than stages, and a ring refilled more than once.
        (16, 64, 3, 1, [300, 65, 130, 15], 1, jnp.bfloat16, 4),
        # Float8 pages, upcast block by block in SMEM: the oracle is the attention of the pages' float8 values.
        (16, 64, 3, 3, [64, 65, 15, 130], 1, jnp.float8_e4m3fn, 3),
        (8, 128, 4, 2, [200, 1, 64], 4, jnp.float8_e5m2, 2),
        # 256-wide heads (Gemma's): the split partials' accumulators in bfloat16, where float32 does not fit.
        (16, 256, 2, 1, [200, 1, 64], 4, jnp.bfloat16, 2),
        # 256-wide float8 pages: each block upcast in 64 x 128 chunks.
        (16, 256, 2, 1, [130, 9], 1, jnp.float8_e4m3fn, 2),
        # 192-wide heads (MiMo-V2-Flash's), group 8, with splits.
        (16, 192, 8, 1, [130, 9, 64], 2, jnp.bfloat16, 2),
    ],
    ids=["bf16-smollm", "bf16-llama-splits", "bf16-4-stages", "e4m3-smollm-3-stages", "e5m2-llama-splits",
         "bf16-256-splits", "e4m3-256", "bf16-192-group8"],
)
def test_mosaic_decode_kernel_matches_oracle(page_size, head_dim, group, kv_heads, kv_lens, splits, kv_dtype,
                                             stages):
    rng = np.random.default_rng(page_size + head_dim)
    pages_per_seq = -(-max(kv_lens) // page_size) + 1
    batch = make_batch(rng, page_size=page_size, head_dim=head_dim, group=group, num_kv_heads=kv_heads,
                       dtype=jnp.bfloat16, seqs=[(1, n) for n in kv_lens], pages_per_seq=pages_per_seq,
                       pad_tokens=0, pad_seqs=0)
    batch = dataclasses.replace(batch, k_pages=quantize_kv(batch.k_pages, kv_dtype),
                                v_pages=quantize_kv(batch.v_pages, kv_dtype))
    assert batch.k_pages.dtype == kv_dtype
    out = paged_decode_attention_mosaic(
        batch.q, batch.k_pages, batch.v_pages, batch.block_tables, batch.seq_lens,
        sm_scale=head_dim**-0.5, num_splits=splits, stages=stages, interpret=_interpret(),
    )
    assert out.shape == batch.q.shape and out.dtype == jnp.bfloat16
    _check(out, batch, head_dim**-0.5)


@pytest.mark.parametrize("splits,sinks", [(1, False), (4, False), (1, True), (4, True)])
def test_mosaic_decode_window_and_soft_cap(splits, sinks):
    """A sliding window of 70 keys and a logit soft-cap: the walk starts at the window's first KV block (a token
    at 299 reads blocks 3-4 of 5), the window's edge is masked inside a block, and the flash-decoding splits
    divide the window's blocks only; with attention sinks (gpt-oss), whole (its partials then written for one
    split) or split, each head's sink joins the denominator once."""
    rng = np.random.default_rng(11)
    batch = make_batch(rng, page_size=16, head_dim=64, group=3, num_kv_heads=3, dtype=jnp.bfloat16,
                       seqs=[(1, n) for n in (300, 65, 15, 130, 1)], pages_per_seq=20, pad_tokens=0, pad_seqs=0)
    extra = {"sinks": jnp.asarray(rng.uniform(0.0, 3.0, 9), jnp.float32)} if sinks else {}
    out = paged_decode_attention_mosaic(batch.q, batch.k_pages, batch.v_pages, batch.block_tables, batch.seq_lens,
                                        sm_scale=0.125, soft_cap=5.0, sliding_window=70, num_splits=splits,
                                        interpret=_interpret(), **extra)
    _check(out, batch, 0.125, soft_cap=5.0, sliding_window=70, **{k: np.asarray(v) for k, v in extra.items()})
    with pytest.raises(ValueError, match="sliding_window must be a positive int"):
        paged_decode_attention_mosaic(batch.q, batch.k_pages, batch.v_pages, batch.block_tables, batch.seq_lens,
                                      sm_scale=0.125, sliding_window=0, interpret=True)


@pytest.mark.parametrize("splits", [1, 4])
def test_mosaic_decode_chunks(splits):
    """Llama 4's chunked attention, chunks of 96 positions: a token at 299 walks block 4 alone (its chunk starts at
    288), one at 129 blocks 1-2 (from 96, masked inside block 1), one at 95 a whole first chunk; the
    flash-decoding splits divide the chunk's blocks only."""
    rng = np.random.default_rng(12)
    batch = make_batch(rng, page_size=16, head_dim=64, group=3, num_kv_heads=3, dtype=jnp.bfloat16,
                       seqs=[(1, n) for n in (300, 96, 15, 130, 1)], pages_per_seq=20, pad_tokens=0, pad_seqs=0)
    out = paged_decode_attention_mosaic(batch.q, batch.k_pages, batch.v_pages, batch.block_tables, batch.seq_lens,
                                        sm_scale=0.125, attention_chunk=96, num_splits=splits, interpret=_interpret())
    _check(out, batch, 0.125, attention_chunk=96)


def test_mosaic_dispatch_per_kernel():
    """Each kind of batch goes to its own Mosaic kernel by that kernel's limits: 256-wide heads fit the
    warp-specialized prefill kernel (compiled form) and the decode kernel (its split partials in bfloat16); with
    float8 pages the warp-specialized form does not fit, so their chunks take the one-warpgroup form. A window
    and a soft-cap go to both Mosaic kernels."""
    rng = np.random.default_rng(5)

    def traced(head_dim, interpret, kv_dtype=jnp.bfloat16, **scores):
        batch = make_batch(rng, page_size=16, head_dim=head_dim, group=2, num_kv_heads=2, dtype=jnp.bfloat16,
                           seqs=[(1, 40), (5, 21)], pages_per_seq=4)
        pages = quantize_kv(batch.k_pages, kv_dtype), quantize_kv(batch.v_pages, kv_dtype)
        tuning = AttentionTuning(decode_lowering="mosaic", prefill_lowering="mosaic")
        return str(jax.make_jaxpr(lambda q: ragged_paged_attention(
            q, *pages, batch.block_tables, batch.seq_lens, batch.query_start_loc,
            sm_scale=0.125, interpret=interpret, tuning=tuning, **scores))(batch.q))

    wide = traced(256, interpret=False)
    assert "ragged_attention_mosaic_ws" in wide and "paged_decode_mosaic" in wide
    assert "ragged_paged_attention_bq" not in wide  # no generic kernel left
    wide_fp8 = traced(256, interpret=False, kv_dtype=jnp.float8_e4m3fn)
    assert "ragged_attention_mosaic_bq" in wide_fp8 and "mosaic_ws" not in wide_fp8
    assert "paged_decode_mosaic" in wide_fp8 and "ragged_paged_attention_bq" not in wide_fp8
    # In the interpreter prefill takes the one-warpgroup form, which 256-wide heads fit too.
    interpreted = traced(256, interpret=True)
    assert "ragged_attention_mosaic_bq" in interpreted and "ragged_paged_attention_bq" not in interpreted
    windowed = traced(64, interpret=True, soft_cap=30.0, sliding_window=16)
    assert "paged_decode_mosaic" in windowed and "ragged_attention_mosaic" in windowed
    assert "ragged_paged_attention_bq" not in windowed
    # Attention sinks: decode batches on the decode kernel, batches with chunks on the warp-specialized one.
    sinks = traced(64, interpret=False, sinks=jnp.zeros((4,), jnp.float32))
    assert "paged_decode_mosaic" in sinks and "ragged_attention_mosaic_ws" in sinks
    assert "ragged_paged_attention_bq" not in sinks


DECODE_SEQS, MIXED_SEQS = [(1, 40), (0, 0), (1, 17)], [(1, 40), (5, 21), (1, 17)]


# Float8 pages in a mixed batch reach all three kernels; their decode-only batches are the decode kernel's tests'.
@pytest.mark.parametrize("seqs,kv_dtype", [(DECODE_SEQS, jnp.bfloat16), (MIXED_SEQS, jnp.bfloat16),
                                           (MIXED_SEQS, jnp.float8_e4m3fn)], ids=["decode", "mixed", "mixed-e4m3"])
def test_decode_lowering_mosaic_dispatch(seqs, kv_dtype):
    """Decode batches (padding sequences included) take the Mosaic kernel; a prefill chunk sends the whole
    call to the generic kernel (both are in the traced call, under a cond on the query lengths). Both agree
    with the oracle, padding tokens come back zero. Float32 pages under bfloat16 queries stay generic."""
    rng = np.random.default_rng(7)
    batch = make_batch(rng, page_size=16, head_dim=64, group=3, num_kv_heads=3, dtype=jnp.bfloat16,
                       seqs=seqs, pages_per_seq=4)
    batch = dataclasses.replace(batch, k_pages=quantize_kv(batch.k_pages, kv_dtype),
                                v_pages=quantize_kv(batch.v_pages, kv_dtype))

    def attend(k_pages, v_pages, prefill_lowering="triton", split_mixed=True):
        tuning = AttentionTuning(decode_lowering="mosaic", prefill_lowering=prefill_lowering,
                                 split_mixed=split_mixed)
        return ragged_paged_attention(
            batch.q, k_pages, v_pages, batch.block_tables, batch.seq_lens, batch.query_start_loc,
            sm_scale=0.125, interpret=_interpret(), tuning=tuning,
        )

    traced = str(jax.make_jaxpr(attend)(batch.k_pages, batch.v_pages))
    assert "paged_decode_mosaic" in traced and "ragged_attention_mosaic" not in traced
    wide = batch.k_pages.astype(jnp.float32)
    assert "paged_decode_mosaic" not in str(jax.make_jaxpr(attend)(wide, wide))
    # Prefill chunks on the generic or the ragged Mosaic kernel; with the ragged one, a batch's decode tokens
    # beside its chunks on the decode kernel (split_mixed) or on the ragged kernel with them.
    # (A decode batch takes the decode kernel whatever serves chunks: one of the three forms for it.)
    forms = (("triton", True), ("mosaic", True), ("mosaic", False)) if seqs is MIXED_SEQS else (("mosaic", True),)
    for prefill_lowering, split_mixed in forms:
        out = attend(batch.k_pages, batch.v_pages, prefill_lowering, split_mixed)
        _check(out, batch, 0.125)
        assert not np.asarray(out[batch.num_real_tokens:], np.float32).any(), "padding tokens must be zero"
    for split_mixed, decode_calls in ((True, 2), (False, 1)):  # the decode kernel in the mixed branch too
        mixed = functools.partial(attend, prefill_lowering="mosaic", split_mixed=split_mixed)
        both = str(jax.make_jaxpr(mixed)(batch.k_pages, batch.v_pages))
        assert both.count("jaxpr=paged_decode_attention_mosaic") == decode_calls  # call sites
        assert "ragged_attention_mosaic" in both


def test_mosaic_refusals():
    assert mosaic_decode_supported(jnp.bfloat16, 64, 16, 3) is None
    assert "bfloat16" in mosaic_decode_supported(jnp.float32, 64, 16, 3)
    assert "head_dim" in mosaic_decode_supported(jnp.bfloat16, 96, 16, 3)
    assert "page_size" in mosaic_decode_supported(jnp.bfloat16, 64, 4, 3)
    assert "WGMMA" in mosaic_decode_supported(jnp.bfloat16, 64, 16, 65)
    # 256-token blocks of 128-wide heads overflow Hopper's shared memory (the sm_90 compile says 315432 bytes).
    # 256-wide heads fit 64-token blocks, with their split partials in bfloat16 rather than float32.
    assert mosaic_decode_supported(jnp.bfloat16, 256, 16, 8) is None
    assert partial_dtype(jnp.bfloat16, 256, 64, jnp.bfloat16, 2) == jnp.bfloat16
    assert partial_dtype(jnp.bfloat16, 128, 64, jnp.bfloat16, 2) == jnp.float32
    assert smem_bytes(2, 128, 256) >= 315432  # the compile's count, in the float32-partial form
    assert mosaic_decode_supported(jnp.bfloat16, 128, 16, 4, block_kv=128) is None
    assert "shared memory" in mosaic_decode_supported(jnp.bfloat16, 128, 16, 4, block_kv=256)
    # The ring: 5 stages of 64-token blocks of 128-wide heads fit (226 KiB with the tiles), 6 do not.
    assert mosaic_decode_supported(jnp.bfloat16, 128, 16, 4, stages=5) is None
    assert "in 6 stages needs" in mosaic_decode_supported(jnp.bfloat16, 128, 16, 4, stages=6)
    assert "at least 2 stages" in mosaic_decode_supported(jnp.bfloat16, 64, 16, 3, stages=1)
    # Float8 pages under bfloat16 queries (upcast in SMEM); pages of another width are refused.
    assert mosaic_decode_supported(jnp.bfloat16, 128, 16, 4, kv_dtype=jnp.float8_e4m3fn) is None
    assert "float8" in mosaic_decode_supported(jnp.bfloat16, 64, 16, 3, kv_dtype=jnp.float32)
    # The upcast tiles cost SMEM too: 128-token blocks of 128-wide float8 heads fit, 256 do not.
    assert mosaic_decode_supported(jnp.bfloat16, 128, 16, 4, block_kv=128, kv_dtype=jnp.float8_e5m2) is None
    assert "shared memory" in mosaic_decode_supported(jnp.bfloat16, 128, 16, 4, block_kv=256,
                                                      kv_dtype=jnp.float8_e5m2)
    with pytest.raises(ValueError, match="decode_lowering"):
        AttentionTuning(decode_lowering="cuda")
    with pytest.raises(ValueError, match="prefill_lowering"):
        AttentionTuning(prefill_lowering="cudnn")
    q = jnp.zeros((2, 6, 64), jnp.float32)
    pages = jnp.zeros((4, 16, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        paged_decode_attention_mosaic(q, pages, pages, jnp.zeros((2, 2), jnp.int32), jnp.ones(2, jnp.int32),
                                      sm_scale=0.125, interpret=True)


def test_decode_promise_calls_the_decode_kernel_alone():
    """`decode=True` (an engine's decode loop): the call holds the Mosaic decode kernel only, not the branch for
    prefill chunks on the ragged kernel (less to compile in every decode bucket); the oracle's output, padding
    tokens zero. Without the promise the same batch traces both branches."""
    rng = np.random.default_rng(11)
    batch = make_batch(rng, page_size=16, head_dim=64, group=3, num_kv_heads=3, dtype=jnp.bfloat16,
                       seqs=DECODE_SEQS, pages_per_seq=4, pad_tokens=1)
    tuning = AttentionTuning(decode_lowering="mosaic", prefill_lowering="mosaic")

    def attend(*args, decode):
        return ragged_paged_attention(*args, sm_scale=0.125, interpret=_interpret(), tuning=tuning, decode=decode)

    args = (batch.q, batch.k_pages, batch.v_pages, batch.block_tables, batch.seq_lens, batch.query_start_loc)
    promised = str(jax.make_jaxpr(functools.partial(attend, decode=True))(*args))
    assert "paged_decode_mosaic" in promised
    assert "ragged_attention_mosaic" not in promised and "ragged_paged_attention_bq" not in promised
    assert "ragged_attention_mosaic" in str(jax.make_jaxpr(functools.partial(attend, decode=False))(*args))
    out = attend(*args, decode=True)
    _check(out, batch, 0.125)
    assert not np.asarray(out[batch.num_real_tokens:], np.float32).any(), "padding tokens must be zero"
