"""Ragged paged attention: the Pallas kernel (interpret mode) against the reference, and the reference
against a naive per-token oracle."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels import AttentionTuning, ragged_paged_attention, ragged_paged_attention_reference

try:  # tests/ as a package, or tests/ itself on sys.path (pytest's rootdir-less layout)
    from tests.test_kernels_cases import (
        SPAN_SEQS,
        SPANS,
        make_batch,
        naive_attention,
        span_last_key,
        standard_seqs,
    )
except ImportError:
    from test_kernels_cases import SPAN_SEQS, SPANS, make_batch, naive_attention, span_last_key, standard_seqs

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}


def _interpret() -> bool:
    """Interpret mode on the CPU; compiled kernels when a GPU is the default backend (bench/gpu_check.sh)."""
    return jax.default_backend() == "cpu"


def _check(batch, dtype, **kwargs):
    tuning = kwargs.pop("tuning", AttentionTuning())
    ref = ragged_paged_attention_reference(
        batch.q,
        batch.k_pages,
        batch.v_pages,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        **kwargs,
    )
    out = ragged_paged_attention(
        batch.q,
        batch.k_pages,
        batch.v_pages,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        interpret=_interpret(),
        tuning=tuning,
        **kwargs,
    )
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    out = np.asarray(out.astype(jnp.float32))
    ref = np.asarray(ref.astype(jnp.float32))
    # The interpreter fills kernel outputs with NaN, so a tile the kernel never wrote fails here (on a GPU,
    # such a tile would hold leftover memory and almost surely mismatch).
    assert np.isfinite(out).all(), "non-finite output (unwritten tile or NaN from the scratch page)"
    n = batch.num_real_tokens
    np.testing.assert_allclose(out[:n], ref[:n], atol=TOL[dtype], rtol=TOL[dtype])


# Pairwise cover of page size x head dim x GQA group x dtype, each with a tuning that exercises another path:
# decode rows without tensor-core padding, padded rows, several query blocks per sequence, KV splits.
SWEEP = [
    # page_size, head_dim, group, kv_heads, dtype, tuning, soft_cap, sliding_window
    (8, 64, 1, 2, jnp.float32, AttentionTuning(), None, None),
    (16, 64, 3, 1, jnp.bfloat16, AttentionTuning(), None, None),
    (32, 128, 4, 1, jnp.float32, AttentionTuning(block_q=8, block_kv=32), None, 37),
    (8, 128, 8, 1, jnp.bfloat16, AttentionTuning(block_q=2, num_kv_splits=2), None, None),
    (16, 128, 1, 2, jnp.bfloat16, AttentionTuning(block_q=1), 2.0, None),
    (32, 64, 8, 1, jnp.float32, AttentionTuning(block_q=4, num_kv_splits=4, block_kv=16), None, None),
    (8, 64, 3, 2, jnp.float32, AttentionTuning(block_q=1, num_kv_splits=2, block_kv=8), 2.0, 11),
    (16, 64, 4, 2, jnp.float32, AttentionTuning(block_q=1, pad_rows_to_mma=True, block_kv=16), None, 5),
    # Heads that are no power of two, read in power-of-two parts: Phi-3-mini's 96 (64 + 32), MiMo-V2-Flash's 192
    # (128 + 64) with KV splits and a window, 48 (32 + 16) on rows padded to the tensor cores.
    (16, 96, 3, 1, jnp.bfloat16, AttentionTuning(), None, None),
    (8, 192, 2, 2, jnp.float32, AttentionTuning(block_q=2, num_kv_splits=2), None, 9),
    (8, 48, 4, 1, jnp.float32, AttentionTuning(block_q=2, pad_rows_to_mma=True, block_kv=16), 2.0, None),
    # Gemma 4's full-attention heads, 512 wide, a window.
    (16, 512, 4, 1, jnp.bfloat16, AttentionTuning(), None, 20),
]


def test_wide_heads_take_fewer_keys_a_step():
    """Heads over 256 wide step through 32 keys at a time on tensor-core rows (64 overflow Hopper's shared memory)."""
    from pallas_kernels.ragged_paged_attention import _resolve_tuning

    padded = AttentionTuning(pad_rows_to_mma=True)
    assert [_resolve_tuning(padded, 64, 4, 1, 4, 1024, d)[3] for d in (128, 256, 512)] == [64, 64, 32]


@pytest.mark.parametrize("page_size,head_dim,group,kv_heads,dtype,tuning,soft_cap,sliding_window", SWEEP)
def test_kernel_matches_reference(
    page_size, head_dim, group, kv_heads, dtype, tuning, soft_cap, sliding_window
):
    rng = np.random.default_rng(page_size * 1000 + head_dim + group)
    pages_per_seq = 4
    batch = make_batch(
        rng,
        page_size=page_size,
        head_dim=head_dim,
        group=group,
        num_kv_heads=kv_heads,
        dtype=dtype,
        seqs=standard_seqs(page_size, pages_per_seq),
        pages_per_seq=pages_per_seq,
    )
    # With a soft cap, a large scale pushes the logits into the cap's non-linear range.
    sm_scale = 0.5 if soft_cap else head_dim**-0.5
    _check(batch, dtype, sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window, tuning=tuning)


def test_decode_batch_default_tuning():
    """T == S (a decode bucket): one query per program, rows not padded to 16 (in the interpreter; compiled, 16-bit
    queries pad them for the tensor cores); sequences share pages."""
    rng = np.random.default_rng(3)
    seqs = [(1, n) for n in (1, 7, 8, 9, 16, 17, 31, 32)]
    batch = make_batch(
        rng,
        page_size=8,
        head_dim=64,
        group=3,
        num_kv_heads=3,
        dtype=jnp.bfloat16,
        seqs=seqs,
        pages_per_seq=4,
        num_pages=6,
        pad_tokens=1,
        pad_seqs=1,
    )
    tables = np.asarray(batch.block_tables)
    assert len(np.unique(tables[tables > 0])) < np.count_nonzero(tables)  # some pages are shared
    _check(batch, jnp.bfloat16, sm_scale=0.125)


def test_decode_rows_pad_to_the_tensor_cores_by_default_when_compiled_with_16_bit_queries():
    """`pad_rows_to_mma=None`: padded (64-key blocks, tensor-core dots) when compiled with bfloat16 or float16
    queries; unpadded (32-key blocks) for float32 and in the interpreter; as given when set."""
    rng = np.random.default_rng(5)
    kernels = {}
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
        batch = make_batch(rng, page_size=8, head_dim=64, group=3, num_kv_heads=3, dtype=dtype,
                           seqs=[(1, 9), (1, 17)], pages_per_seq=4)
        args = (batch.q, batch.k_pages, batch.v_pages, batch.block_tables, batch.seq_lens, batch.query_start_loc)
        for interpret, pad in ((False, None), (True, None), (False, False), (True, True)):
            fn = functools.partial(ragged_paged_attention, sm_scale=0.125, interpret=interpret,
                                   tuning=AttentionTuning(pad_rows_to_mma=pad))
            text = str(jax.make_jaxpr(fn)(*args))
            kernels[jnp.dtype(dtype).name, interpret, pad] = "bkv64" in text, "bkv32" in text
    for (dtype, interpret, pad), (padded, unpadded) in kernels.items():
        want = pad if pad is not None else (not interpret and dtype != "float32")
        assert (padded, unpadded) == (want, not want), (dtype, interpret, pad)


def test_long_decode_splits_by_default():
    """One sequence, long context: the default tuning splits the KV length (flash decoding)."""
    rng = np.random.default_rng(4)
    batch = make_batch(
        rng,
        page_size=16,
        head_dim=64,
        group=4,
        num_kv_heads=2,
        dtype=jnp.float32,
        seqs=[(1, 16 * 64 - 3)],
        pages_per_seq=64,
        num_pages=70,
        pad_tokens=0,
        pad_seqs=0,
    )
    from pallas_kernels.ragged_paged_attention import _resolve_tuning

    *_, splits, _ = _resolve_tuning(AttentionTuning(), 1, 1, 2, 4, 16 * 64)
    assert splits > 1
    _check(batch, jnp.float32, sm_scale=0.125)


@pytest.mark.parametrize("soft_cap,sliding_window", [(None, None), (3.0, 6)])
def test_reference_matches_naive_oracle(soft_cap, sliding_window):
    rng = np.random.default_rng(11)
    # Few sequences and many heads take the reference's dense path; many sequences take the gather path.
    for seqs, group in ((standard_seqs(8, 4), 1), ([(2, 9), (1, 3)], 2)):
        batch = make_batch(
            rng,
            page_size=8,
            head_dim=16,
            group=group,
            num_kv_heads=2,
            dtype=jnp.float32,
            seqs=seqs,
            pages_per_seq=4,
        )
        ref = ragged_paged_attention_reference(
            batch.q,
            batch.k_pages,
            batch.v_pages,
            batch.block_tables,
            batch.seq_lens,
            batch.query_start_loc,
            sm_scale=0.3,
            soft_cap=soft_cap,
            sliding_window=sliding_window,
        )
        want = naive_attention(batch, sm_scale=0.3, soft_cap=soft_cap, sliding_window=sliding_window)
        n = batch.num_real_tokens
        np.testing.assert_allclose(np.asarray(ref)[:n], want[:n], atol=2e-5, rtol=2e-5)
        np.testing.assert_array_equal(np.asarray(ref)[n:], 0.0)


def test_interpreter_poisons_unwritten_outputs():
    """The poison the kernel tests rely on: an output tile the kernel skips reads back as NaN."""

    def kernel(o_ref):
        @pl.when(pl.program_id(0) == 0)
        def _():
            o_ref[...] = jnp.zeros_like(o_ref)

    out = pl.pallas_call(
        kernel,
        grid=(2,),
        out_specs=pl.BlockSpec((4,), lambda i: (i,)),
        out_shape=jax.ShapeDtypeStruct((8,), jnp.float32),
        interpret=True,
    )()
    assert np.all(np.asarray(out[:4]) == 0) and np.all(np.isnan(np.asarray(out[4:])))


def _args(T=4, QH=4, D=64, NP=3, PS=8, KVH=2, S=2, P=2, dtype=jnp.float32):
    return [
        jnp.zeros((T, QH, D), dtype),
        jnp.zeros((NP, PS, KVH, D), dtype),
        jnp.zeros((NP, PS, KVH, D), dtype),
        jnp.zeros((S, P), jnp.int32),
        jnp.zeros((S,), jnp.int32),
        jnp.zeros((S + 1,), jnp.int32),
    ]


@pytest.mark.parametrize(
    "fn", [ragged_paged_attention_reference, functools.partial(ragged_paged_attention, interpret=True)]
)
@pytest.mark.parametrize(
    "mutate,error,match",
    [
        (lambda a: a.__setitem__(0, a[0][None]), ValueError, "q must be"),
        (lambda a: a.__setitem__(2, a[2][:, :4]), ValueError, "v_pages shape"),
        (lambda a: a.__setitem__(0, jnp.zeros((4, 3, 64))), ValueError, "multiple of num_kv_heads"),
        (lambda a: a.__setitem__(0, jnp.zeros((4, 4, 32))), ValueError, "head_dim of q"),
        (lambda a: a.__setitem__(4, jnp.zeros((3,), jnp.int32)), ValueError, "seq_lens must be"),
        (lambda a: a.__setitem__(5, jnp.zeros((2,), jnp.int32)), ValueError, "query_start_loc must be"),
        (
            lambda a: a.__setitem__(
                3, jnp.zeros((2, 2), jnp.int64 if jax.config.x64_enabled else jnp.uint32)
            ),
            TypeError,
            "block_tables must be int32",
        ),
        (lambda a: a.__setitem__(1, a[1].astype(jnp.bfloat16)), TypeError, "dtype"),
    ],
)
def test_validation_messages(fn, mutate, error, match):
    args = _args()
    mutate(args)
    with pytest.raises(error, match=match):
        fn(*args, sm_scale=0.125)


@pytest.mark.parametrize(
    "fn", [ragged_paged_attention_reference, functools.partial(ragged_paged_attention, interpret=True)]
)
def test_sinks_must_be_one_per_query_head(fn):
    with pytest.raises(ValueError, match=r"sinks must be a float \[4\] \(one logit per query head\), got float32 \(2,\)"):
        fn(*_args(), sm_scale=0.125, sinks=jnp.zeros((2,), jnp.float32))


def test_row_pages_per_block():
    """A row's block of keys stays within 32 KiB: SmolLM2's float32 pages (16 x 3 x 64) go 2 at a time,
    bfloat16 ones 4, pages of 8 x 128 heads one at a time, tiny test heads 16."""
    from jaxserve.models.attention import row_pages_per_block

    assert row_pages_per_block(16, 3, 64, 4) == 2
    assert row_pages_per_block(16, 3, 64, 2) == 4
    assert row_pages_per_block(16, 8, 128, 4) == 1
    assert row_pages_per_block(32, 8, 128, 2) == 1
    assert row_pages_per_block(8, 2, 16, 4) == 16


@pytest.mark.parametrize("decode", [True, False])
def test_xla_backend_row_blocks_not_dividing_the_table(decode):
    """Rows that read 4 pages at a time (8 KiB pages) from tables of 6 pages: the last block is
    padded with masked keys, and the output still equals the oracle."""
    from jaxserve.models.attention import row_pages_per_block, xla_ragged_paged_attention

    assert row_pages_per_block(8, 4, 64, 4) == 4
    rng = np.random.default_rng(5)
    batch = make_batch(rng, page_size=8, head_dim=64, group=2, num_kv_heads=4, dtype=jnp.float32,
                       seqs=[(1, 47), (1, 33), (1, 1), (1, 30)], pages_per_seq=6)
    args = (batch.q, batch.k_pages, batch.v_pages, batch.block_tables, batch.seq_lens, batch.query_start_loc)
    ref = np.asarray(ragged_paged_attention_reference(*args, sm_scale=0.2))
    got = np.asarray(jax.jit(functools.partial(xla_ragged_paged_attention, sm_scale=0.2, decode=decode,
                                               query_block=2))(*args))
    n = batch.num_real_tokens
    np.testing.assert_allclose(got[:n], ref[:n], atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(got[n:], 0.0)


def test_validation_of_options():
    with pytest.raises(ValueError, match="sliding_window"):
        ragged_paged_attention_reference(*_args(), sm_scale=0.1, sliding_window=0)
    with pytest.raises(ValueError, match="soft_cap"):
        ragged_paged_attention_reference(*_args(), sm_scale=0.1, soft_cap=-1.0)
    with pytest.raises(ValueError, match="attention_chunk must be a positive int"):
        ragged_paged_attention(*_args(), sm_scale=0.1, attention_chunk=0, interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        AttentionTuning(block_q=3)
    with pytest.raises(ValueError, match="head_dim a multiple of 16"):
        ragged_paged_attention(*_args(D=40), sm_scale=0.1, interpret=True)


@pytest.mark.parametrize("pages_per_block", [2, None])  # None: tiles of 6 pages, each row's pages 6 at a time
@pytest.mark.parametrize("soft_cap,sliding_window", [(None, None), (3.0, 6)])
@pytest.mark.parametrize("seqs,query_block,decode", [
    # a mixed batch: prompt chunks of several tiles (partial last tiles, one after a cached prefix) and decodes
    ([(1, 37), (9, 20), (1, 1), (13, 16), (6, 8), (1, 12)], 4, False),
    ([(1, 37), (5, 20), (1, 1), (9, 9)], 32, False),
    # decoding only: every token reads its own pages, all at once (decode) or a chunk at a time
    ([(1, 37), (1, 20), (1, 1), (1, 9), (1, 16)], 4, True),
    ([(1, 37), (1, 20), (1, 1), (1, 9), (1, 16)], 32, True),
    ([(1, 37), (1, 20), (1, 1), (1, 9), (1, 16)], 2, False),
    # eleven decode tokens in a mixed step: pieces of 8, 2 and 1 rows
    ([(1, n) for n in (37, 20, 1, 9, 16, 5, 30, 12, 3, 44, 8)], 32, False),
    ([(1, 37)], 32, True),  # one row
])
def test_engine_xla_backend_matches_reference(soft_cap, sliding_window, seqs, query_block, decode, pages_per_block):
    """The engine's CPU attention (blocks of pages, online softmax; prompt chunks in query tiles)
    equals the kernels' oracle, with sequences longer than one block of pages, padding tokens and
    sequences, and NaN in the scratch page that masked keys point at."""
    from jaxserve.models.attention import xla_ragged_paged_attention

    rng = np.random.default_rng(12)
    pad = dict(pad_tokens=0, pad_seqs=0) if len(seqs) == 1 else {}
    batch = make_batch(rng, page_size=8, head_dim=16, group=3, num_kv_heads=2, dtype=jnp.float32,
                       seqs=seqs, pages_per_seq=6, **pad)
    args = (batch.q, batch.k_pages, batch.v_pages, batch.block_tables, batch.seq_lens, batch.query_start_loc)
    kw = dict(sm_scale=0.3, soft_cap=soft_cap, sliding_window=sliding_window)
    ref = np.asarray(ragged_paged_attention_reference(*args, **kw))
    got = np.asarray(jax.jit(functools.partial(xla_ragged_paged_attention, **kw, pages_per_block=pages_per_block,
                                               query_block=query_block, decode=decode))(*args))
    n = batch.num_real_tokens
    np.testing.assert_allclose(got[:n], ref[:n], atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(got[n:], 0.0)


def _span_batch(rng, page_size=8, head_dim=32, group=3, kv_heads=2, dtype=jnp.float32):
    batch = make_batch(rng, page_size=page_size, head_dim=head_dim, group=group, num_kv_heads=kv_heads, dtype=dtype,
                       seqs=SPAN_SEQS, pages_per_seq=7)
    return batch, span_last_key(batch, SPANS, rng)


@pytest.mark.parametrize("tuning,sliding_window", [
    (AttentionTuning(), None),
    (AttentionTuning(block_q=4, block_kv=16), 9),
    (AttentionTuning(block_q=8, num_kv_splits=2), None),
    (AttentionTuning(block_q=1, pad_rows_to_mma=True), None),
])
def test_spans_attended_both_ways(tuning, sliding_window):
    """With `last_key`, the reference equals the float64 oracle, and the Pallas kernel (rows of one block
    reading different ends) and the engine's CPU attention (prompt tiles and rows) equal the reference; a span's
    tokens see the keys after them, so the outputs differ from causal ones."""
    from jaxserve.models.attention import xla_ragged_paged_attention

    rng = np.random.default_rng(21)
    batch, last_key = _span_batch(rng)
    args = (batch.q, batch.k_pages, batch.v_pages, batch.block_tables, batch.seq_lens, batch.query_start_loc)
    kw = dict(sm_scale=0.3, sliding_window=sliding_window)
    n = batch.num_real_tokens
    ref = np.asarray(ragged_paged_attention_reference(*args, **kw, last_key=last_key))
    want = naive_attention(batch, **kw, last_key=np.asarray(last_key))
    np.testing.assert_allclose(ref[:n], want[:n], atol=2e-5, rtol=2e-5)
    causal = np.asarray(ragged_paged_attention_reference(*args, **kw))
    assert np.abs(causal[:n] - ref[:n]).max() > 0.1
    _check(batch, jnp.float32, **kw, last_key=last_key, tuning=tuning)
    for query_block in (32, 4):
        got = np.asarray(jax.jit(functools.partial(xla_ragged_paged_attention, **kw, query_block=query_block))(
            *args, last_key=last_key))
        np.testing.assert_allclose(got[:n], ref[:n], atol=2e-5, rtol=2e-5)
        np.testing.assert_array_equal(got[n:], 0.0)


def _xla_forms_equal_reference(rng, batch, kw, **per_head):
    """The engine's CPU attention, prompt tiles (`batch`) and decode rows (three sequences of one token, 3 x 2 heads),
    equals the reference with the per-head arrays given (sinks, ALiBi slopes)."""
    from jaxserve.models.attention import xla_ragged_paged_attention

    for decode, seqs in ((False, None), (True, [(1, 19), (1, 1), (1, 12)])):
        b = batch if seqs is None else make_batch(rng, page_size=8, head_dim=32, group=3, num_kv_heads=2,
                                                   dtype=jnp.float32, seqs=seqs, pages_per_seq=4)
        a = (b.q, b.k_pages, b.v_pages, b.block_tables, b.seq_lens, b.query_start_loc)
        want = np.asarray(ragged_paged_attention_reference(*a, **kw, **per_head))
        xla = np.asarray(jax.jit(functools.partial(xla_ragged_paged_attention, **kw, query_block=4,
                                                   decode=decode))(*a, **per_head))
        np.testing.assert_allclose(xla[:b.num_real_tokens], want[:b.num_real_tokens], atol=2e-5, rtol=2e-5)
        np.testing.assert_array_equal(xla[b.num_real_tokens:], 0.0)


@pytest.mark.parametrize("tuning,sliding_window", [
    (AttentionTuning(block_q=4, block_kv=16), 9),  # tensor-core rows (12 padded to 16), a window
    (AttentionTuning(block_q=1, num_kv_splits=2, block_kv=8), None),  # rows unpadded, the KV length split
])
def test_attention_sinks(tuning, sliding_window):
    """gpt-oss's attention sinks (a logit per head that joins the softmax and carries no value): the reference
    equals the float64 oracle, and the Pallas kernel (whole and split over the KV length) and the engine's CPU
    attention (prompt tiles and decode rows) equal the reference; the sinks change every output."""

    rng = np.random.default_rng(21)
    group, kv_heads = 3, 2
    batch = make_batch(rng, page_size=8, head_dim=32, group=group, num_kv_heads=kv_heads, dtype=jnp.float32,
                       seqs=[(1, 19), (9, 20), (1, 1), (13, 16), (1, 12)], pages_per_seq=4)
    sinks = jnp.asarray(rng.uniform(-1.0, 3.0, group * kv_heads), jnp.float32)
    args = (batch.q, batch.k_pages, batch.v_pages, batch.block_tables, batch.seq_lens, batch.query_start_loc)
    kw = dict(sm_scale=0.3, sliding_window=sliding_window)
    ref = np.asarray(ragged_paged_attention_reference(*args, **kw, sinks=sinks))
    n = batch.num_real_tokens
    np.testing.assert_allclose(ref[:n], naive_attention(batch, **kw, sinks=np.asarray(sinks))[:n], atol=2e-5)
    plain = np.asarray(ragged_paged_attention_reference(*args, **kw))
    assert np.abs(ref[:n] - plain[:n]).max(axis=(1, 2)).min() > 1e-3  # every token's output moves
    got = np.asarray(ragged_paged_attention(*args, **kw, sinks=sinks, interpret=_interpret(), tuning=tuning))
    np.testing.assert_allclose(got[:n], ref[:n], atol=2e-5, rtol=2e-5)
    _xla_forms_equal_reference(rng, batch, kw, sinks=sinks)


@pytest.mark.parametrize("tuning", [
    AttentionTuning(block_q=4, block_kv=16),  # tensor-core rows (12 padded to 16)
    AttentionTuning(block_q=1, num_kv_splits=2, block_kv=8),  # rows unpadded, the KV length split
])
def test_alibi_slopes(tuning):
    """ALiBi (Falcon-RW's slopes, 6 heads: 4 of the power of two, 2 of the next): the reference equals the float64
    oracle; the Pallas kernel (whole and split over the KV length) and the engine's CPU attention (prompt tiles and
    decode rows) equal the reference, which the slopes move; the Mosaic GPU kernels leave it to the Pallas kernel."""
    from jaxserve.config_gpt2 import alibi_slopes

    rng = np.random.default_rng(23)
    group, kv_heads = 3, 2
    batch = make_batch(rng, page_size=8, head_dim=32, group=group, num_kv_heads=kv_heads, dtype=jnp.float32,
                       seqs=[(1, 19), (9, 20), (1, 1), (13, 16), (1, 12)], pages_per_seq=4)
    slopes = jnp.asarray(alibi_slopes(group * kv_heads), jnp.float32)
    args = (batch.q, batch.k_pages, batch.v_pages, batch.block_tables, batch.seq_lens, batch.query_start_loc)
    kw = dict(sm_scale=0.3)
    ref = np.asarray(ragged_paged_attention_reference(*args, **kw, alibi=slopes))
    n = batch.num_real_tokens
    np.testing.assert_allclose(ref[:n], naive_attention(batch, **kw, alibi=np.asarray(slopes))[:n], atol=2e-5)
    plain = np.asarray(ragged_paged_attention_reference(*args, **kw))
    assert np.abs(ref[:n] - plain[:n]).max() > 0.1
    for lowering in ("triton", "mosaic"):
        t = dataclasses.replace(tuning, decode_lowering=lowering, prefill_lowering=lowering)
        got = np.asarray(ragged_paged_attention(*args, **kw, alibi=slopes, interpret=_interpret(), tuning=t))
        np.testing.assert_allclose(got[:n], ref[:n], atol=2e-5, rtol=2e-5)
        np.testing.assert_array_equal(got[n:], 0.0)
    _xla_forms_equal_reference(rng, batch, kw, alibi=slopes)
    with pytest.raises(ValueError, match=r"alibi must be a float \[6\] \(one ALiBi slope per query head\)"):
        ragged_paged_attention_reference(*args, **kw, alibi=slopes[:2])


@pytest.mark.parametrize("tuning,sliding_window", [
    (AttentionTuning(block_q=4, block_kv=16), None),  # tensor-core rows, blocks of 4 tokens across chunk edges
    (AttentionTuning(block_q=1, num_kv_splits=2, block_kv=8), None),  # decode rows, the KV walk split
    (AttentionTuning(block_q=8, block_kv=8), 5),  # a window inside the chunks too (the later first key counts)
])
def test_chunked_attention(tuning, sliding_window):
    """Llama 4's chunked attention (chunks of 12 positions): the reference equals the float64 oracle, the Pallas
    kernel (each block's walk starting at its first token's chunk) and the engine's CPU attention (prompt tiles
    and decode rows) equal the reference; tokens past the first chunk see fewer keys than causal ones."""
    from jaxserve.models.attention import xla_ragged_paged_attention

    rng = np.random.default_rng(8)
    batch = make_batch(rng, page_size=8, head_dim=32, group=3, num_kv_heads=2, dtype=jnp.float32,
                       seqs=[(1, 29), (14, 26), (1, 1), (11, 11), (1, 12), (1, 13)], pages_per_seq=4)
    args = (batch.q, batch.k_pages, batch.v_pages, batch.block_tables, batch.seq_lens, batch.query_start_loc)
    kw = dict(sm_scale=0.3, sliding_window=sliding_window)
    ref = np.asarray(ragged_paged_attention_reference(*args, **kw, attention_chunk=12))
    n = batch.num_real_tokens
    np.testing.assert_allclose(ref[:n], naive_attention(batch, **kw, attention_chunk=12)[:n], atol=2e-5)
    causal = np.asarray(ragged_paged_attention_reference(*args, **kw))
    assert np.abs(causal[:n] - ref[:n]).max() > 0.1
    got = np.asarray(ragged_paged_attention(*args, **kw, attention_chunk=12, interpret=_interpret(), tuning=tuning))
    np.testing.assert_allclose(got[:n], ref[:n], atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(got[n:], 0.0)
    for query_block, decode in ((4, False), (32, False)):
        xla = np.asarray(jax.jit(functools.partial(xla_ragged_paged_attention, **kw, chunk=12, query_block=query_block,
                                                   decode=decode))(*args))
        np.testing.assert_allclose(xla[:n], ref[:n], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("tuning", [
    AttentionTuning(block_q=4, block_kv=16),  # prompt chunks on tensor-core rows
    AttentionTuning(block_q=1, num_kv_splits=2, block_kv=8),  # decode rows, the KV walk split
])
def test_kernel_reads_one_copy_of_each_kv_head(tuning):
    """Pages holding each KV head twice over (Gemma 4's full-attention rows, head h as heads 2h and 2h + 1): with
    `kv_copies=2` the kernel reads the first copies only (the second ones are NaN here) and equals the reference over
    the heads held once; the reference over the doubled heads equals it too; copies that do not divide the pages'
    heads are refused."""
    rng = np.random.default_rng(27)
    batch = make_batch(rng, page_size=8, head_dim=32, group=4, num_kv_heads=2, dtype=jnp.float32,
                       seqs=[(1, 19), (9, 20), (1, 1), (13, 16), (1, 12)], pages_per_seq=4)
    rest = (batch.block_tables, batch.seq_lens, batch.query_start_loc)
    kw = dict(sm_scale=0.3, sliding_window=None)
    ref = np.asarray(ragged_paged_attention_reference(batch.q, batch.k_pages, batch.v_pages, *rest, **kw))
    doubled = [jnp.repeat(p, 2, axis=2) for p in (batch.k_pages, batch.v_pages)]
    n = batch.num_real_tokens
    both = np.asarray(ragged_paged_attention_reference(batch.q, *doubled, *rest, **kw))
    np.testing.assert_allclose(both[:n], ref[:n], atol=2e-5, rtol=2e-5)
    poisoned = [p.at[:, :, 1::2].set(jnp.nan) for p in doubled]
    got = np.asarray(ragged_paged_attention(batch.q, *poisoned, *rest, **kw, kv_copies=2, interpret=_interpret(),
                                            tuning=tuning))
    np.testing.assert_allclose(got[:n], ref[:n], atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match=r"kv_copies \(3\) must divide the pages' 4 KV heads"):
        ragged_paged_attention(batch.q, *doubled, *rest, **kw, kv_copies=3, interpret=True)
