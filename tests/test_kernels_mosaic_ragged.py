"""The ragged Mosaic GPU attention kernel (prefill chunks and decode tokens in one call) in Mosaic GPU's CPU
interpreter against the float64 oracle: blocks of several query tokens of a GQA group in one WGMMA tile, causal
within the chunk, over cached context, pages shared between sequences, float8 pages, padding tokens zero.

The interpreter simulates SMEM, the TMA page copies and the barriers; it runs the two products as plain dots.
In it the kernel's default form is the one-warpgroup one (tests/test_kernels_mosaic_ws.py runs the
warp-specialized form in a child process). The WGMMA path is compiled for sm_90 in tests/gpu_compile; on a GPU
these tests run the compiled kernel in its default form (warp-specialized on pages of q's dtype).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import ragged_paged_attention
from pallas_kernels.paged_decode_mosaic import ROWS
from pallas_kernels.ragged_attention_args import block_splits, default_splits, quantize_kv
from pallas_kernels.ragged_attention_mosaic import ragged_paged_attention_mosaic
from tests import test_kernels_cases as cases
from tests.test_kernels_cases import make_batch, naive_attention, standard_seqs

TOL = 3e-2  # bfloat16 queries and probabilities


def _run(batch, sm_scale, **kw):
    return ragged_paged_attention_mosaic(
        batch.q, batch.k_pages, batch.v_pages, batch.block_tables, batch.seq_lens, batch.query_start_loc,
        sm_scale=sm_scale, interpret=jax.default_backend() == "cpu", **kw,
    )


def _check(out, batch, sm_scale, **scores):
    ref = naive_attention(batch, sm_scale=sm_scale, **scores)
    out = np.asarray(out.astype(jnp.float32))
    n = batch.num_real_tokens
    assert out.shape == batch.q.shape
    assert np.isfinite(out[:n]).all(), "non-finite output: a scratch-page row reached the products"
    np.testing.assert_allclose(out[:n], ref[:n], atol=TOL, rtol=TOL)
    assert not out[n:].any(), "padding tokens must be zero"


@pytest.mark.parametrize(
    "page_size,head_dim,group,kv_heads,kv_dtype",
    [
        (16, 64, 3, 3, jnp.bfloat16),  # SmolLM2 heads: 21 tokens per block, one padding row
        (8, 128, 4, 2, jnp.bfloat16),  # Llama-3-8B heads: 16 tokens per block, 8 page copies per KV block
        (16, 64, 1, 2, jnp.float8_e4m3fn),  # MHA: 64 tokens per block; float8 pages upcast in SMEM
        (16, 64, 8, 1, jnp.float8_e5m2),  # 8 tokens per block
        (16, 192, 8, 1, jnp.bfloat16),  # MiMo-V2-Flash's 192-wide heads
    ],
    ids=["smollm", "llama-8-token-pages", "mha-e4m3", "group8-e5m2", "mimo-192"],
)
def test_ragged_mosaic_matches_oracle(page_size, head_dim, group, kv_heads, kv_dtype):
    rng = np.random.default_rng(page_size * group + head_dim)
    pages_per_seq = 5
    # Page boundaries, prefill chunks over cached context, decode tokens, a full table; and a prompt longer
    # than one block of queries, so a sequence spans blocks whose causal limits differ.
    seqs = standard_seqs(page_size, pages_per_seq) + [(ROWS // group + 5, pages_per_seq * page_size - 3)]
    batch = make_batch(rng, page_size=page_size, head_dim=head_dim, group=group, num_kv_heads=kv_heads,
                       dtype=jnp.bfloat16, seqs=seqs, pages_per_seq=pages_per_seq)
    batch = dataclasses.replace(batch, k_pages=quantize_kv(batch.k_pages, kv_dtype),
                                v_pages=quantize_kv(batch.v_pages, kv_dtype))
    out = _run(batch, head_dim**-0.5)
    assert out.dtype == jnp.bfloat16
    _check(out, batch, head_dim**-0.5)


def test_ragged_mosaic_block_kv_128_and_empty_batch_rows():
    """128-key blocks (two WGMMA N tiles), and rows of the batch with no query tokens between real ones."""
    rng = np.random.default_rng(3)
    seqs = [(40, 150), (0, 0), (1, 129), (0, 0), (70, 70)]
    batch = make_batch(rng, page_size=16, head_dim=64, group=3, num_kv_heads=3, dtype=jnp.bfloat16,
                       seqs=seqs, pages_per_seq=10)
    _check(_run(batch, 0.125, block_kv=128), batch, 0.125)


def _sinks(rng, batch, on: bool) -> dict:
    """gpt-oss's attention sinks (a logit per query head joining each softmax, carrying no value), or none."""
    return {"sinks": jnp.asarray(rng.uniform(0.0, 3.0, batch.q.shape[1]), jnp.float32)} if on else {}


@pytest.mark.parametrize("window,sinks", [(20, False), (70, True)])
def test_ragged_mosaic_window_and_soft_cap(window, sinks):
    """A sliding window and a logit soft-cap: blocks of 21 tokens whose windows start in different KV blocks (a
    block's walk starts where its first token's window does; rows that see no key of an early block stay
    finite), a window shorter than a block of queries (20), a decode token and a short prompt; with attention
    sinks, the partials of a single split are written and combined with each row's sink."""
    rng = np.random.default_rng(window)
    batch = make_batch(rng, page_size=16, head_dim=64, group=3, num_kv_heads=2, dtype=jnp.bfloat16,
                       seqs=[(50, 110), (1, 137), (0, 0), (7, 7), (30, 200)], pages_per_seq=14)
    extra = _sinks(rng, batch, sinks)
    _check(_run(batch, 0.125, soft_cap=4.0, sliding_window=window, **extra), batch, 0.125, soft_cap=4.0,
           sliding_window=window, **{k: np.asarray(v) for k, v in extra.items()})


@pytest.mark.parametrize("window,splits", [(None, None), (20, 3)])
def test_ragged_mosaic_chunks(window, splits):
    """Llama 4's chunked attention, chunks of 48 positions: blocks of 21 tokens whose rows fall in two chunks (a
    block's walk starts at its first token's chunk; its later rows see none of the earlier chunk), a decode token
    past a chunk edge, a prompt across one; with a window inside the chunks too, and the KV walk split."""
    rng = np.random.default_rng(48)
    batch = make_batch(rng, page_size=16, head_dim=64, group=3, num_kv_heads=2, dtype=jnp.bfloat16,
                       seqs=[(50, 110), (1, 150), (0, 0), (60, 60)], pages_per_seq=10)
    kw = dict(sliding_window=window, attention_chunk=48)
    _check(_run(batch, 0.125, compute_wgs=1, num_splits=splits, **kw), batch, 0.125, **kw)


@pytest.mark.parametrize("splits,window,sinks", [(3, None, False), (4, 40, True)])
def test_ragged_mosaic_splits_each_blocks_kv_walk(splits, window, sinks):
    """Flash-decoding splits in the one-warpgroup form (a short step over long contexts: drafts verified as
    chunks). Blocks of several tokens whose causal limits fall in different splits, a prompt spanning two
    query blocks, a short sequence whose later splits are empty, and with a window, a walk starting past the
    first splits' keys: the combined partials (with attention sinks: and each row's sink) equal the oracle."""
    rng = np.random.default_rng(splits)
    seqs = [(5, 300), (1, 290), (4, 37), (25, 260), (0, 0)]
    batch = make_batch(rng, page_size=16, head_dim=64, group=3, num_kv_heads=2, dtype=jnp.bfloat16, seqs=seqs,
                       pages_per_seq=20)
    extra = _sinks(rng, batch, sinks)
    _check(_run(batch, 0.125, compute_wgs=1, num_splits=splits, sliding_window=window, **extra), batch, 0.125,
           sliding_window=window, **{k: np.asarray(v) for k, v in extra.items()})


def test_ragged_mosaic_split_refusals_and_default():
    rng = np.random.default_rng(1)
    batch = make_batch(rng, page_size=16, head_dim=64, group=3, num_kv_heads=2, dtype=jnp.bfloat16,
                       seqs=[(3, 20)], pages_per_seq=2)
    for kw in (dict(num_splits=0, compute_wgs=1), dict(num_splits=2, compute_wgs=2)):
        with pytest.raises(ValueError, match="num_splits must be a positive count"):
            _run(batch, 0.125, **kw)
    # Decode blocks: splits fill the GPU where the keys are many.
    assert default_splits(4, 8, 8192, 64) == 16 and default_splits(4, 2, 8192, 64) == 32
    assert default_splits(128, 8, 8192, 64) == 1 and default_splits(2, 8, 256, 64) == 1
    # Blocks of several tokens: 4 drafted requests over 8k keys (6 blocks) split; one 2k-token prompt of
    # 256-wide heads (65 blocks over its own 2k keys) does not, as its float32 partials would outweigh its K/V.
    assert block_splits(6, 4, 8, 8192, 64, ROWS, 128, 2) == 8
    assert block_splits(65, 1, 2, 8192, 64, ROWS, 256, 1) == 1


def test_ragged_mosaic_skips_the_sequences_it_is_told_to():
    """`skip_seqs`: the marked sequences (decode tokens the caller attends on the decode kernel) get no programs
    and their tokens come back zero (the last sequence's too, under which the unused blocks are filed); the
    others equal the oracle."""
    rng = np.random.default_rng(4)
    seqs = [(1, 40), (30, 70), (1, 17), (0, 0), (25, 25), (1, 90)]
    batch = make_batch(rng, page_size=16, head_dim=64, group=3, num_kv_heads=2, dtype=jnp.bfloat16, seqs=seqs,
                       pages_per_seq=7, pad_seqs=0)
    skip = np.array([q == 1 for q, _ in seqs])
    out = np.asarray(_run(batch, 0.125, skip_seqs=jnp.asarray(skip)).astype(jnp.float32))
    ref = naive_attention(batch, sm_scale=0.125)
    qsl = np.asarray(batch.query_start_loc)
    skipped = np.zeros(out.shape[0], bool)
    for s in np.flatnonzero(skip):
        skipped[qsl[s]:qsl[s + 1]] = True
    assert skipped.sum() == 3 and not out[skipped].any()
    n = batch.num_real_tokens
    kept = ~skipped[:n]
    np.testing.assert_allclose(out[:n][kept], ref[:n][kept], atol=TOL, rtol=TOL)
    with pytest.raises(ValueError, match="skip_seqs must be bool"):
        _run(batch, 0.125, skip_seqs=jnp.zeros(2, jnp.bool_))


@pytest.mark.parametrize("crowded", [False, True])
def test_ragged_mosaic_spans_attended_both_ways(crowded):
    """`last_key`: each block's spans read from its metadata (two to a block of 21 tokens, starting before the
    chunk, crossing blocks), the decode tokens beside; with `crowded`, a block meeting three spans, which sends
    the batch to the generic kernel (the Mosaic kernel would take its middle span's tokens as causal)."""
    rng = np.random.default_rng(7)
    batch = make_batch(rng, page_size=16, head_dim=64, group=3, num_kv_heads=2, dtype=jnp.bfloat16,
                       seqs=cases.SPAN_SEQS, pages_per_seq=4)
    spans = [[(3, 6), (7, 10), (12, 15), (22, 31)], *cases.SPANS[1:]] if crowded else cases.SPANS
    last_key = cases.span_last_key(batch, spans, rng)
    out = _run(batch, 0.125, last_key=last_key, sliding_window=None if crowded else 12)
    _check(out, batch, 0.125, last_key=np.asarray(last_key), sliding_window=None if crowded else 12)


def test_ragged_mosaic_refusals():
    rng = np.random.default_rng(0)
    batch = make_batch(rng, page_size=16, head_dim=64, group=3, num_kv_heads=3, dtype=jnp.float32,
                       seqs=[(3, 20)], pages_per_seq=2)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        _run(batch, 0.125)
    bf = dataclasses.replace(batch, q=batch.q.astype(jnp.bfloat16), k_pages=batch.k_pages.astype(jnp.bfloat16),
                             v_pages=batch.v_pages.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="block_kv"):
        _run(bf, 0.125, block_kv=48)
    with pytest.raises(ValueError, match="sm_scale"):
        _run(bf, -1.0)


# Random ragged batches in fixed shapes (so each page size compiles once): up to 4 sequences, each a prefill
# chunk over cached context, a decode token, or nothing, padded to 96 tokens and 5 rows.
MAX_TOKENS, MAX_SEQS, PAGES_PER_SEQ = 96, 5, 6


@st.composite
def _ragged_batches(draw):
    page_size = draw(st.sampled_from([8, 16]))
    capacity = PAGES_PER_SEQ * page_size
    seqs, room = [], MAX_TOKENS
    for _ in range(draw(st.integers(1, MAX_SEQS - 1))):
        kv_len = draw(st.integers(0, capacity))
        q_len = draw(st.integers(min(kv_len, 1), min(kv_len, room, 40)))
        seqs.append((q_len, kv_len))
        room -= q_len
    return page_size, seqs, draw(st.integers(0, 2**31 - 1))


@settings(max_examples=8, deadline=None, derandomize=True)
@given(_ragged_batches())
def test_ragged_mosaic_random_batches_match_the_oracle_and_the_generic_kernel(case):
    """Property: on any ragged batch both the ragged Mosaic kernel and the generic kernel equal the oracle."""
    page_size, seqs, seed = case
    total = sum(q for q, _ in seqs)
    batch = make_batch(np.random.default_rng(seed), page_size=page_size, head_dim=64, group=3, num_kv_heads=2,
                       dtype=jnp.bfloat16, seqs=seqs, pages_per_seq=PAGES_PER_SEQ, pad_tokens=MAX_TOKENS - total,
                       pad_seqs=MAX_SEQS - len(seqs), num_pages=MAX_SEQS * PAGES_PER_SEQ)
    _check(_run(batch, 0.125), batch, 0.125)
    generic = ragged_paged_attention(
        batch.q, batch.k_pages, batch.v_pages, batch.block_tables, batch.seq_lens, batch.query_start_loc,
        sm_scale=0.125, interpret=jax.default_backend() == "cpu",
    )
    _check(generic, batch, 0.125)
