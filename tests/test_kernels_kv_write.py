"""The paged KV write: Pallas kernel (interpret mode) and reference against a hand-built expectation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import attention_backend, triton_available, write_kv, write_kv_reference, write_kv_triton


def _writer(name):
    """The KV write under test: the reference, the Pallas kernel (interpreted on the CPU), or the Triton kernel
    through jax_triton (a GPU with jax_triton only)."""
    if name == "reference":
        return write_kv_reference
    if name == "pallas":
        return lambda *a: write_kv(*a, interpret=jax.default_backend() == "cpu")
    if jax.default_backend() != "gpu" or not triton_available():
        pytest.skip("the Triton KV write needs a GPU and jax_triton")
    return write_kv_triton


def _case(rng, num_pages, page_size, kv_heads, head_dim, num_tokens, num_pad, dtype):
    shape = (num_pages, page_size, kv_heads, head_dim)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    # Real tokens fill distinct slots outside the scratch page; padding tokens point at page 0.
    slots = rng.choice(np.arange(page_size, num_pages * page_size), num_tokens, replace=False)
    slots = np.concatenate([slots, rng.integers(0, page_size, num_pad)]).astype(np.int32)
    k_new = rng.standard_normal((num_tokens + num_pad, kv_heads, head_dim)).astype(np.float32)
    v_new = rng.standard_normal((num_tokens + num_pad, kv_heads, head_dim)).astype(np.float32)
    want_k, want_v = k.copy(), v.copy()
    for t in range(num_tokens):
        want_k[slots[t] // page_size, slots[t] % page_size] = k_new[t]
        want_v[slots[t] // page_size, slots[t] % page_size] = v_new[t]
    arrays = [jnp.asarray(a, dtype) for a in (k, v, k_new, v_new)]
    return (*arrays, jnp.asarray(slots)), (want_k, want_v)


@pytest.mark.parametrize("writer", ["reference", "pallas", "triton"])
@pytest.mark.parametrize(
    "page_size,kv_heads,head_dim,num_tokens,num_pad,dtype",
    [
        (8, 3, 64, 21, 3, jnp.float32),  # tokens not a multiple of the block, non-power-of-two KV heads
        (32, 2, 128, 40, 0, jnp.bfloat16),
    ],
)
def test_write_kv(writer, page_size, kv_heads, head_dim, num_tokens, num_pad, dtype):
    fn = _writer(writer)
    rng = np.random.default_rng(page_size + num_tokens)
    args, (want_k, want_v) = _case(rng, 9, page_size, kv_heads, head_dim, num_tokens, num_pad, dtype)
    # Fresh copies: the kernels' wrappers donate the pages.
    k, v = fn(jnp.array(args[0]), jnp.array(args[1]), *args[2:])
    # Every non-scratch row is checked: written rows hold the new values, the rest are untouched.
    np.testing.assert_array_equal(
        np.asarray(k.astype(jnp.float32))[1:], np.asarray(jnp.asarray(want_k, dtype).astype(jnp.float32))[1:]
    )
    np.testing.assert_array_equal(
        np.asarray(v.astype(jnp.float32))[1:], np.asarray(jnp.asarray(want_v, dtype).astype(jnp.float32))[1:]
    )


def test_write_kv_validation():
    k = jnp.zeros((2, 8, 2, 64))
    good = dict(
        k_new=jnp.zeros((3, 2, 64)), v_new=jnp.zeros((3, 2, 64)), slot_mapping=jnp.zeros((3,), jnp.int32)
    )
    with pytest.raises(ValueError, match="k_new must be"):
        write_kv_reference(k, k, **{**good, "k_new": jnp.zeros((3, 1, 64))})
    with pytest.raises(ValueError, match="slot_mapping must be"):
        write_kv_reference(k, k, **{**good, "slot_mapping": jnp.zeros((4,), jnp.int32)})
    with pytest.raises(TypeError, match="slot_mapping must be int32"):
        write_kv_reference(k, k, **{**good, "slot_mapping": jnp.zeros((3,), jnp.float32)})
    with pytest.raises(TypeError, match="k_new dtype"):
        write_kv_reference(k, k, **{**good, "k_new": jnp.zeros((3, 2, 64), jnp.bfloat16)})
    with pytest.raises(ValueError, match="v_pages shape"):
        write_kv_reference(k, jnp.zeros((2, 8, 2, 32)), **good)


def test_backend_dispatch():
    xla = attention_backend("xla")
    assert xla.write_kv_impl == "xla"
    interp = attention_backend("pallas_interpret")
    assert interp.write_kv_impl == "pallas"
    mosaic_interp = attention_backend("pallas_mosaic_interpret")
    assert mosaic_interp.write_kv_impl == "pallas"
    assert mosaic_interp.attention.keywords["tuning"].prefill_lowering == "mosaic"
    assert mosaic_interp.attention.keywords["interpret"] is True
    gpu = attention_backend("pallas")
    # Without jax_triton (no CUDA plugin) the KV write falls back to the XLA scatter.
    assert gpu.write_kv_impl == ("triton" if triton_available() else "xla")
    with pytest.raises(ValueError, match="unknown attention backend"):
        attention_backend("cuda")
    with pytest.raises(ValueError, match="needs a Pallas backend"):
        attention_backend("xla", kv_write="pallas")
    if not triton_available():
        with pytest.raises(ValueError, match="needs jax_triton"):
            attention_backend("pallas", kv_write="triton")
