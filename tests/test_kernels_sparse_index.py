"""The indexer kernel (DeepSeek Sparse Attention's key scores) in interpret mode against its reference, and the
reference against a float64 oracle: tokens of several sequences over shuffled pages shared between sequences,
positions at and around page and chunk edges, a padding token, stale pages full of NaN past each sequence, heads
padded to a power of two, several chunks a row, float32 / bfloat16 / float8 pages, a second KV head's copy never read;
and the top-k the engine takes from the scores against the xla backend's running choice."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_attention_args import quantize_kv
from pallas_kernels.sparse_index import index_scores, index_scores_reference, score_capacity

INTERPRET = jax.default_backend() == "cpu"  # (on a GPU: the compiled kernel, bench/gpu_check.sh)
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}


def _case(rng, *, heads=3, dim=16, offset=24, width=48, page_size=8, pages_per_seq=6, num_pages=20, kv_heads=1,
          dtype=jnp.float32, kv_dtype=None):
    """Three sequences (their lengths at a page edge, one past it, one short), tokens at their last positions and
    inside them, a padding token; page 0 a scratch page of NaN that the tables' unused entries point at."""
    seq_lens = np.array([2 * page_size, 3 * page_size + 1, 5])
    tables = np.zeros((3, pages_per_seq), np.int32)
    free = list(rng.permutation(np.arange(1, num_pages)))
    for s, n in enumerate(-(-seq_lens // page_size)):
        tables[s, :n] = [free.pop() for _ in range(n)]
    tables[2, 0] = tables[0, 0]  # a page shared by two sequences
    seq = np.array([0, 0, 1, 1, 1, 2, 0], np.int32)
    pos = np.array([page_size - 1, 2 * page_size - 1, 0, 3 * page_size, 3 * page_size - 1, 4, -1], np.int32)
    pages = rng.normal(size=(num_pages, page_size, kv_heads, width)).astype(np.float32)
    pages[0] = np.nan
    if kv_heads > 1:
        pages[:, :, 1:] = np.nan  # only the first copy is read
    q = rng.normal(size=(len(seq), heads, dim)).astype(np.float32)
    w = rng.normal(size=(len(seq), heads)).astype(np.float32)
    pages = quantize_kv(jnp.asarray(pages, dtype), kv_dtype or dtype)
    return (jnp.asarray(q, dtype), jnp.asarray(w), pages, jnp.asarray(tables), jnp.asarray(seq), jnp.asarray(pos),
            offset)


def _oracle(q, w, pages, tables, seq, pos, offset, scale):
    q, w = np.asarray(q.astype(jnp.float32), np.float64), np.asarray(w, np.float64)
    pages = np.asarray(pages.astype(jnp.float32), np.float64)[:, :, 0]
    tables, seq, pos = np.asarray(tables), np.asarray(seq), np.asarray(pos)
    page_size, dim = pages.shape[1], q.shape[2]
    out = np.full((len(seq), tables.shape[1] * page_size), -np.inf)
    for t in range(len(seq)):
        for j in range(pos[t] + 1):
            key = pages[tables[seq[t], j // page_size], j % page_size, offset:offset + dim]
            out[t, j] = w[t] @ np.maximum(q[t] @ key * scale, 0)
    return out


@pytest.mark.parametrize("case,tune", [
    (dict(), dict()),  # 3 heads padded to 4; one chunk a row
    (dict(heads=5, dim=32, offset=0, width=32), dict(chunk=16, block_kv=8)),  # 3 chunks a row, keys at dim 0
    (dict(dtype=jnp.bfloat16, kv_heads=2), dict(chunk=32, block_kv=16)),  # a second copy of NaN, never read
    (dict(dtype=jnp.bfloat16, kv_dtype=jnp.float8_e4m3fn, heads=16), dict()),  # float8 pages
])
def test_kernel_matches_reference_and_oracle(case, tune):
    rng = np.random.default_rng(len(case) + 3 * len(tune))
    args = _case(rng, **case)
    *arrays, offset = args
    q, pages, tables = arrays[0], arrays[2], arrays[3]
    scale = q.shape[2] ** -0.5
    kw = dict(key_offset=offset, scale=scale, chunk=tune.get("chunk"))
    ref = np.asarray(index_scores_reference(*arrays, **kw))
    L = score_capacity(tables, pages.shape[1], tune.get("chunk"))
    assert ref.shape == (q.shape[0], L)
    want = _oracle(*arrays, offset, scale)
    tol = TOL[jnp.dtype(q.dtype).type]
    np.testing.assert_allclose(ref[:, : want.shape[1]], want, atol=tol, rtol=tol)
    assert np.isneginf(ref[:, want.shape[1]:]).all()
    got = np.asarray(index_scores(*arrays, key_offset=offset, scale=scale, interpret=INTERPRET, **tune))
    seen = np.isfinite(want)
    assert seen.sum() > 50 and (np.isneginf(got[:, : want.shape[1]]) == ~seen).all()
    assert np.isneginf(got[:, want.shape[1]:]).all() and np.isneginf(got[-1]).all()  # padding: nothing seen
    np.testing.assert_allclose(got[:, : want.shape[1]][seen], want[seen], atol=tol, rtol=tol)


def test_three_dim_pages_and_traced_positions():
    """A pool of one KV head may drop its axis; positions are values (an engine step's): one compiled kernel."""
    rng = np.random.default_rng(4)
    q, w, pages, tables, seq, pos, offset = _case(rng)
    fn = jax.jit(lambda *a: index_scores(*a, key_offset=offset, scale=0.25, interpret=INTERPRET))
    for p in (pos, jnp.maximum(pos - 3, -1)):
        want = index_scores_reference(q, w, pages, tables, seq, p, key_offset=offset, scale=0.25)
        np.testing.assert_allclose(np.asarray(fn(q, w, pages[:, :, 0], tables, seq, p)), np.asarray(want),
                                   atol=2e-5, rtol=2e-5)


def test_refusals():
    rng = np.random.default_rng(0)
    q, w, pages, tables, seq, pos, offset = _case(rng)
    kw = dict(key_offset=offset, scale=0.25, interpret=True)
    with pytest.raises(ValueError, match="w must be float32"):
        index_scores(q, w.astype(jnp.bfloat16), pages, tables, seq, pos, **kw)
    with pytest.raises(ValueError, match="token_pos must be int32"):
        index_scores(q, w, pages, tables, seq, pos[:-1], **kw)
    with pytest.raises(ValueError, match="inside the entries' width"):
        index_scores(q, w, pages, tables, seq, pos, **{**kw, "key_offset": 40})
    with pytest.raises(ValueError, match="power-of-two key dim"):
        index_scores(q[..., :12], w, pages, tables, seq, pos, **kw)
    with pytest.raises(ValueError, match="chunk must be a power of two"):
        index_scores(q, w, pages, tables, seq, pos, **kw, chunk=24)
    with pytest.raises(TypeError, match="cannot serve q"):
        index_scores(q, w, pages.astype(jnp.int8), tables, seq, pos, **kw)
    assert index_scores(q[:0], w[:0], pages, tables, seq[:0], pos[:0], **kw).shape == (0, 64)


@pytest.mark.parametrize("rows", [None, 2])
def test_kernel_choice_equals_the_xla_choice(rows, monkeypatch):
    """The slots the Pallas backends attend (the kernel's scores, each row's top-k) are the xla backend's (a running
    top-k over blocks of pages), in a mixed batch; in rows of tokens when the scores' memory says so."""
    from jaxserve.models import sparse_mla

    rng = np.random.default_rng(1)
    page_size, key_dim, Di, Hi, topk = 4, 12, 16, 4, 6
    seq_lens, q_lens = np.array([19, 9, 23, 3]), np.array([7, 9, 1, 1])
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    T = int(qsl[-1]) + 2
    tables = np.zeros((4, 8), np.int32)
    free = list(rng.permutation(np.arange(1, 40)))
    for s, n in enumerate(-(-seq_lens // page_size)):
        tables[s, :n] = [free.pop() for _ in range(n)]
    pool = jnp.asarray(rng.normal(size=(40, page_size, key_dim + Di)), jnp.float32)
    iq = jnp.asarray(rng.normal(size=(T, Hi, Di)), jnp.float32)
    iw = jnp.asarray(rng.normal(size=(T, Hi)), jnp.float32)
    args = (iq, iw, pool, jnp.asarray(tables), jnp.asarray(seq_lens, jnp.int32), qsl)
    want_slots, want_lens = sparse_mla.chosen_keys(*args, key_dim=key_dim, topk=topk)
    if rows:
        monkeypatch.setattr(sparse_mla, "SCORE_BYTES", rows * 4 * 32)
    slots, lens = sparse_mla.scored_keys(*args, key_dim=key_dim, topk=topk, interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(lens), np.asarray(want_lens))
    lens = np.asarray(lens)
    seen = np.arange(topk)[None, :] < lens[:, None]
    assert seen.sum() > 60
    np.testing.assert_array_equal(np.asarray(slots[0])[seen], np.asarray(want_slots[0])[seen])
