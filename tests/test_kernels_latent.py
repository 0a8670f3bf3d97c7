"""The latent attention kernel (DeepSeek's absorbed multi-head latent attention over pages of one entry per token):
interpret mode on the CPU against its reference, the paged attention with the pages as keys and values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import AttentionTuning
from pallas_kernels.latent_attention import (
    latent_paged_attention,
    latent_paged_attention_reference,
    latent_tuning,
)
from tests.test_kernels_cases import make_batch, standard_seqs

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}


def _interpret() -> bool:
    return jax.default_backend() == "cpu"


def _batch(seed, page_size, value_dim, rope_dim, group, kv_heads, dtype, seqs=None, pages_per_seq=4, **kw):
    rng = np.random.default_rng(seed)
    return make_batch(rng, page_size=page_size, head_dim=value_dim + rope_dim, group=group, num_kv_heads=kv_heads,
                      dtype=dtype, seqs=seqs or standard_seqs(page_size, pages_per_seq), pages_per_seq=pages_per_seq,
                      **kw)


def _check(batch, value_dim, dtype, tuning=AttentionTuning(), pages=None, sm_scale=0.2, tol=None):
    pages = batch.k_pages if pages is None else pages
    args = (batch.q, pages, batch.block_tables, batch.seq_lens, batch.query_start_loc)
    ref = latent_paged_attention_reference(*args, value_dim=value_dim, sm_scale=sm_scale)
    out = latent_paged_attention(*args, value_dim=value_dim, sm_scale=sm_scale, interpret=_interpret(), tuning=tuning)
    assert out.shape == (*batch.q.shape[:2], value_dim) and out.dtype == batch.q.dtype
    out, ref = np.asarray(out.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32))
    # Interpreted outputs start as NaN, and page 0 (every table's filler) holds NaN: a tile the kernel never wrote,
    # or a key it should not have read, fails here.
    assert np.isfinite(out).all(), "non-finite output (unwritten tile or NaN from the scratch page)"
    n = batch.num_real_tokens
    np.testing.assert_allclose(out[:n], ref[:n], atol=tol or TOL[dtype], rtol=tol or TOL[dtype])
    np.testing.assert_array_equal(out[n:], 0.0)
    return out


# Page size x latent / rotary dims x heads per entry x KV heads x dtype, each with a tuning that takes another path:
# tiny groups without tensor-core dots, padded rows, a group cut into blocks of heads, several query blocks a
# sequence, KV splits.
SWEEP = [
    # page_size, value_dim, rope_dim, group, kv_heads, dtype, tuning
    (8, 32, 16, 1, 2, jnp.float32, AttentionTuning()),
    (16, 64, 32, 16, 1, jnp.bfloat16, AttentionTuning()),
    (32, 32, 16, 4, 1, jnp.float32, AttentionTuning(block_q=8, block_kv=32)),
    (8, 64, 16, 8, 1, jnp.bfloat16, AttentionTuning(latent_heads=4, num_kv_splits=2)),
    (16, 32, 0, 3, 1, jnp.float32, AttentionTuning(block_q=1)),
    (32, 32, 16, 16, 2, jnp.float32, AttentionTuning(latent_heads=8, block_q=2, num_kv_splits=4, block_kv=16)),
    (8, 32, 8, 6, 1, jnp.float32, AttentionTuning(latent_heads=4, block_q=1, pad_rows_to_mma=True, block_kv=8)),
]


@pytest.mark.parametrize("page_size,value_dim,rope_dim,group,kv_heads,dtype,tuning", SWEEP)
def test_kernel_matches_reference(page_size, value_dim, rope_dim, group, kv_heads, dtype, tuning):
    batch = _batch(page_size * 100 + group, page_size, value_dim, rope_dim, group, kv_heads, dtype)
    _check(batch, value_dim, dtype, tuning)


def test_group_cut_into_blocks_of_heads():
    """latent_heads=4 over a group of 6 takes the largest divisor, 3 heads a program (two programs per block)."""
    t = latent_tuning(AttentionTuning(latent_heads=4), 8, 8, 1, 6, 64, 48, 32, 4)
    assert t["heads"] == 3
    # DeepSeek-V3's 128 heads per entry: 64 at a time by default, decode rows of one token.
    t = latent_tuning(AttentionTuning(), 32, 32, 1, 128, 8192, 576, 512, 2)
    assert (t["heads"], t["block_q"], t["rows"], t["use_mma"]) == (64, 1, 64, True)
    batch = _batch(7, 8, 32, 16, 6, 1, jnp.float32)
    _check(batch, 32, jnp.float32, AttentionTuning(latent_heads=4))


def test_pages_without_their_axis_of_one_head():
    """A pool of one entry per token may come as [N, page_size, D] (the engine drops the axis of one KV head)."""
    batch = _batch(11, 16, 64, 32, 16, 1, jnp.float32)
    four = _check(batch, 64, jnp.float32)
    three = _check(batch, 64, jnp.float32, pages=batch.k_pages[:, :, 0])
    np.testing.assert_array_equal(three, four)


def test_decode_batch_and_long_context_split_by_default():
    """A decode bucket (one query token per sequence, shared pages) and one long sequence: the default tuning
    splits the KV length of the long one."""
    seqs = [(1, n) for n in (1, 7, 8, 9, 16, 17, 31, 32)]
    batch = _batch(3, 8, 32, 16, 16, 1, jnp.bfloat16, seqs=seqs, num_pages=6, pad_tokens=1)
    _check(batch, 32, jnp.bfloat16)
    long = _batch(4, 8, 32, 16, 16, 1, jnp.float32, seqs=[(1, 250)], pages_per_seq=32, pad_tokens=0)
    assert latent_tuning(AttentionTuning(), 1, 2, 1, 16, 256, 48, 32, 4)["splits"] > 1
    _check(long, 32, jnp.float32)


@pytest.mark.parametrize("kv_dtype", [jnp.float8_e4m3fn, jnp.bfloat16])
def test_narrow_pages_upcast_in_the_kernel(kv_dtype):
    """Float8 (`--kv-cache-dtype fp8`) or bfloat16 entries under wider queries: the kernel upcasts what it loads,
    as the reference reads the pages back in q's dtype."""
    batch = _batch(5, 16, 64, 32, 16, 1, jnp.float32)
    pages = batch.k_pages.astype(kv_dtype)
    _check(batch, 64, jnp.float32, pages=pages, tol=1e-4)


MAX_TOKENS, MAX_SEQS, PAGES_PER_SEQ = 48, 5, 6


@st.composite
def _ragged_batches(draw):
    """Up to MAX_SEQS sequences of random KV lengths (0 to a full table) and query lengths (decode tokens to whole
    prompts), the batch padded to fixed sizes; heads per entry and page size drawn too."""
    page_size = draw(st.sampled_from([8, 16]))
    capacity, room, seqs = PAGES_PER_SEQ * page_size, MAX_TOKENS, []
    for _ in range(draw(st.integers(1, MAX_SEQS))):
        kv_len = draw(st.integers(0, capacity))
        q_len = draw(st.integers(min(kv_len, 1), min(kv_len, room)))
        seqs.append((q_len, kv_len))
        room -= q_len
    return page_size, draw(st.sampled_from([1, 2, 5, 16])), seqs, draw(st.integers(0, 2**31 - 1))


@settings(max_examples=8, deadline=None, derandomize=True)
@given(_ragged_batches())
def test_random_ragged_batches_match_the_reference(case):
    """Property: on any ragged batch (empty sequences, full tables, chunks and decode tokens mixed) the kernel
    equals its reference."""
    page_size, group, seqs, seed = case
    total = sum(q for q, _ in seqs)
    batch = _batch(seed, page_size, 32, 16, group, 1, jnp.float32, seqs=seqs, pages_per_seq=PAGES_PER_SEQ,
                   pad_tokens=MAX_TOKENS - total, pad_seqs=MAX_SEQS + 1 - len(seqs), num_pages=MAX_SEQS * PAGES_PER_SEQ)
    _check(batch, 32, jnp.float32)


@pytest.mark.parametrize("mutate,error,match", [
    (dict(value_dim=0), ValueError, "value_dim must be in 1..head_dim"),
    (dict(value_dim=49), ValueError, "value_dim must be in 1..head_dim"),
    (dict(value_dim=24), ValueError, "power-of-two latent and rotary dims, got 24 \\+ 24"),
    (dict(q=jnp.zeros((4, 4, 40), jnp.float32)), ValueError, "head_dim of q \\(40\\) differs"),
    (dict(pages=jnp.zeros((3, 8, 3, 48), jnp.float32)), ValueError, "multiple of num_kv_heads"),
    (dict(block_tables=jnp.zeros((2, 2), jnp.float32)), TypeError, "block_tables must be int32"),
])
def test_validation_messages(mutate, error, match):
    args = dict(q=jnp.zeros((4, 4, 48), jnp.float32), pages=jnp.zeros((3, 8, 48), jnp.float32),
                block_tables=jnp.zeros((2, 2), jnp.int32), seq_lens=jnp.zeros((2,), jnp.int32),
                query_start_loc=jnp.zeros((3,), jnp.int32), value_dim=32)
    args.update(mutate)
    with pytest.raises(error, match=match):
        latent_paged_attention(**args, sm_scale=0.1, interpret=True)


def test_tuning_refuses_no_heads():
    with pytest.raises(ValueError, match="latent_heads must be positive"):
        AttentionTuning(latent_heads=0)
