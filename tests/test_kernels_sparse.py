"""The sparse latent attention kernel (DeepSeek Sparse Attention's attention step) in interpret mode against its
reference, and the reference against a float64 oracle: tokens over the entries chosen for them (shuffled, from
pages shared between tokens), counts from none (a padding token) to the whole top-k, stale slots past each count
pointing at a scratch page full of NaN, several KV heads (a tensor-parallel pool's copies), float32 / bfloat16 /
float8 pages, heads split over programs, the chosen entries split over programs (flash decoding)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import AttentionTuning
from pallas_kernels.ragged_attention_args import quantize_kv
from pallas_kernels.sparse_latent_attention import sparse_latent_attention, sparse_latent_attention_reference

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}
INTERPRET = jax.default_backend() == "cpu"  # (on a GPU: the compiled kernel, bench/gpu_check.sh)


def _case(rng, *, tokens=7, q_heads=8, kv_heads=1, value_dim=32, rope_dim=16, extra=16, topk=20, page_size=8,
          num_pages=12, dtype=jnp.float32, kv_dtype=None):
    key_dim = value_dim + rope_dim
    pages = rng.normal(size=(num_pages, page_size, kv_heads, key_dim + extra)).astype(np.float32)
    pages[0] = np.nan  # the scratch page: what stale slots point at
    q = rng.normal(size=(tokens, q_heads, key_dim)).astype(np.float32)
    lens = rng.integers(1, topk + 1, size=tokens).astype(np.int32)
    lens[1], lens[2] = 0, topk  # a padding token, a token with the whole top-k
    real = np.arange(page_size, num_pages * page_size)  # every slot but the scratch page's
    slots = np.zeros((kv_heads, tokens, topk), np.int32)
    for t in range(tokens):
        for h in range(kv_heads):  # (each copy may be read in its own order)
            slots[h, t, : lens[t]] = rng.choice(real, size=lens[t], replace=False)
    q = jnp.asarray(q, dtype)
    pages = quantize_kv(jnp.asarray(pages, dtype), kv_dtype or dtype)
    return q, pages, jnp.asarray(slots), jnp.asarray(lens), key_dim, value_dim


def _oracle(q, pages, slots, lens, key_dim, value_dim, sm_scale):
    q, pages = np.asarray(q.astype(jnp.float32), np.float64), np.asarray(pages.astype(jnp.float32), np.float64)
    slots, lens = np.asarray(slots), np.asarray(lens)
    tokens, q_heads, _ = q.shape
    kv_heads = pages.shape[2]
    flat = pages.reshape(-1, kv_heads, pages.shape[-1])
    out = np.zeros((tokens, q_heads, value_dim))
    for t in range(tokens):
        for h in range(q_heads):
            kh = h // (q_heads // kv_heads)
            entries = flat[slots[kh, t, : lens[t]], kh]
            if not len(entries):
                continue
            s = entries[:, :key_dim] @ q[t, h] * sm_scale
            p = np.exp(s - s.max())
            out[t, h] = p / p.sum() @ entries[:, :value_dim]
    return out


@pytest.mark.parametrize("case,tuning", [
    (dict(), AttentionTuning()),  # 8 heads, one program a token, rows unpadded
    (dict(q_heads=20, kv_heads=2, dtype=jnp.bfloat16), AttentionTuning(latent_heads=8, block_kv=8)),  # 5 heads of
    # each KV head's 10 a program (rows padded to 8); the two copies' slots differ
    (dict(q_heads=16, topk=40, tokens=3), AttentionTuning(num_kv_splits=4, block_kv=8)),  # splits: a token's
    # later ones empty
    (dict(dtype=jnp.bfloat16, kv_dtype=jnp.float8_e4m3fn), AttentionTuning(pad_rows_to_mma=True)),  # float8 pages,
    # tensor-core dots over rows padded to 16
    (dict(rope_dim=0, value_dim=64, extra=0), AttentionTuning()),  # entries of keys alone, all of them values
])
def test_kernel_matches_reference_and_oracle(case, tuning):
    rng = np.random.default_rng(len(case) + 7 * (tuning.block_kv or 1))
    q, pages, slots, lens, key_dim, value_dim = _case(rng, **case)
    kw = dict(key_dim=key_dim, value_dim=value_dim, sm_scale=0.2)
    ref = sparse_latent_attention_reference(q, pages, slots, lens, **kw)
    assert ref.shape == (q.shape[0], q.shape[1], value_dim) and ref.dtype == q.dtype
    want = _oracle(q, pages, slots, lens, key_dim, value_dim, 0.2)
    tol = TOL[jnp.dtype(q.dtype).type]
    np.testing.assert_allclose(np.asarray(ref, np.float32), want, atol=tol, rtol=tol)
    got = sparse_latent_attention(q, pages, slots, lens, **kw, interpret=INTERPRET, tuning=tuning)
    got = np.asarray(got.astype(jnp.float32))
    assert np.isfinite(got).all(), "a stale slot's NaN reached the output"
    np.testing.assert_allclose(got, np.asarray(ref, np.float32), atol=tol, rtol=tol)
    assert not got[1].any()  # the padding token


def test_three_dim_pages_are_one_kv_head():
    rng = np.random.default_rng(3)
    q, pages, slots, lens, key_dim, value_dim = _case(rng)
    kw = dict(key_dim=key_dim, value_dim=value_dim, sm_scale=0.2)
    np.testing.assert_array_equal(
        np.asarray(sparse_latent_attention(q, pages[:, :, 0], slots, lens, **kw, interpret=INTERPRET)),
        np.asarray(sparse_latent_attention(q, pages, slots, lens, **kw, interpret=INTERPRET)))


def test_refusals():
    rng = np.random.default_rng(0)
    q, pages, slots, lens, key_dim, value_dim = _case(rng)
    kw = dict(key_dim=key_dim, value_dim=value_dim, sm_scale=0.2, interpret=True)
    with pytest.raises(ValueError, match="slots must be int32"):
        sparse_latent_attention(q, pages, slots[0], lens, **kw)
    with pytest.raises(ValueError, match="lens must be int32"):
        sparse_latent_attention(q, pages, slots, lens[:-1], **kw)
    with pytest.raises(ValueError, match="key_dim"):
        sparse_latent_attention(q[..., :-1], pages, slots, lens, **kw)
    with pytest.raises(ValueError, match="value_dim"):
        sparse_latent_attention(q, pages, slots, lens, **{**kw, "value_dim": key_dim + 1})
    with pytest.raises(ValueError, match="power-of-two latent and rotary dims"):
        sparse_latent_attention(q, pages, slots, lens, **{**kw, "value_dim": 24})
    with pytest.raises(TypeError, match="cannot serve q"):
        sparse_latent_attention(q, pages.astype(jnp.int8), slots, lens, **kw)
    assert sparse_latent_attention(q[:0], pages, slots[:, :0], lens[:0], **kw).shape == (0, q.shape[1], value_dim)


def test_kernel_under_jit_with_traced_counts():
    """The counts and slots are values (an engine step's): one compiled kernel serves any."""
    rng = np.random.default_rng(5)
    q, pages, slots, lens, key_dim, value_dim = _case(rng)
    fn = jax.jit(lambda *a: sparse_latent_attention(*a, key_dim=key_dim, value_dim=value_dim, sm_scale=0.2,
                                                    interpret=INTERPRET))
    for n in (lens, jnp.minimum(lens, 3)):
        want = sparse_latent_attention_reference(q, pages, slots, n, key_dim=key_dim, value_dim=value_dim,
                                                 sm_scale=0.2)
        np.testing.assert_allclose(np.asarray(fn(q, pages, slots, n)), np.asarray(want), atol=2e-5, rtol=2e-5)
