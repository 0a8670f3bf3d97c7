"""The Pallas grouped matmul (pallas_kernels/grouped_matmul.py) in interpret mode against `jax.lax.ragged_dot`:
groups empty, small and spanning several blocks, rows past the groups, float32 / bfloat16, int8 and float8 weights;
and a MoE model's logits with the kernel as its experts' matmuls."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul import grouped_matmul, grouped_matmul_reference, kernel_fits

INTERPRET = jax.default_backend() == "cpu"  # compiled on a GPU (bench/gpu_check.sh)


def _case(seed, M, K, N, sizes, x_dtype, w_dtype):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(M, K)), x_dtype)
    if jnp.dtype(w_dtype) == jnp.int8:
        w = jnp.asarray(rng.integers(-127, 128, (len(sizes), K, N)), jnp.int8)
    else:
        w = jnp.asarray(rng.normal(size=(len(sizes), K, N)) * 0.3, w_dtype)
    return x, w, jnp.asarray(sizes, jnp.int32)


@pytest.mark.parametrize("M,K,N,sizes,x_dtype,w_dtype,block_m", [
    (40, 32, 48, [7, 0, 20, 1, 12], jnp.float32, jnp.float32, 16),  # an empty group, one spanning two blocks
    (40, 32, 48, [3, 5, 0, 9], jnp.float32, jnp.float32, None),  # rows past the groups: zeros
    (70, 64, 32, [0, 0, 70], jnp.bfloat16, jnp.bfloat16, 16),  # one group, five blocks
    (24, 16, 16, [8, 8, 8], jnp.float32, jnp.int8, 16),  # int8 weights converted tile by tile
    (33, 48, 64, [11, 0, 22], jnp.bfloat16, jnp.float8_e4m3fn, 32),
])
def test_grouped_matmul_equals_ragged_dot(M, K, N, sizes, x_dtype, w_dtype, block_m):
    x, w, gs = _case(M + K, M, K, N, sizes, x_dtype, w_dtype)
    got = grouped_matmul(x, w, gs, interpret=INTERPRET, block_m=block_m)
    want = grouped_matmul_reference(x, w, gs)
    assert got.dtype == want.dtype == x.dtype and got.shape == (M, N)
    tol = 1e-5 if x_dtype == jnp.float32 else 2e-2
    scale = float(jnp.max(jnp.abs(want.astype(jnp.float32)))) or 1.0
    np.testing.assert_allclose(np.asarray(got, np.float32) / scale, np.asarray(want, np.float32) / scale, atol=tol)
    total = sum(sizes)
    assert not np.asarray(got[total:]).any()


def test_bad_arguments_are_named():
    x, w, gs = _case(0, 8, 16, 16, [4, 4], jnp.float32, jnp.float32)
    with pytest.raises(ValueError, match="w must be"):
        grouped_matmul(x, w[:, :8], gs, interpret=INTERPRET)
    with pytest.raises(ValueError, match="group_sizes must be \\[2\\]"):
        grouped_matmul(x, w, gs[:1], interpret=INTERPRET)
    with pytest.raises(TypeError, match="group_sizes must be int32"):
        grouped_matmul(x, w, gs.astype(jnp.int16), interpret=INTERPRET)
    with pytest.raises(ValueError, match="multiples of 16"):
        grouped_matmul(x[:, :12], w[:, :12], gs, interpret=INTERPRET)
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        grouped_matmul(x, w, gs, interpret=INTERPRET, block_m=24)
    assert kernel_fits(2048, 768) and not kernel_fits(2048, 760)


def test_expert_adapters_through_the_kernel_equal_ragged_dot():
    """A MoE layer's LoRA deltas (every slot's A of each pair's expert, then its slot's B) with the kernel as their
    grouped matmuls: the same as with `jax.lax.ragged_dot`; int8 experts' weights with their scales too."""
    import functools

    from jaxserve.models.lora import expert_lora_deltas
    from jaxserve.models.quantized import QuantizedWeight, grouped

    rng = np.random.default_rng(5)
    S, X, E, F, r, R = 2, 4, 32, 48, 8, 30
    sizes = jnp.asarray([9, 0, 14, 5], jnp.int32)  # 28 of the 30 rows in groups
    row_expert = jnp.asarray(np.repeat(np.arange(X), [9, 0, 14, 5]).tolist() + [X, X], jnp.int32)
    row_slot = jnp.asarray(rng.integers(-1, S, R), jnp.int32)
    xs = jnp.asarray(rng.normal(size=(R, E)), jnp.float32)
    a = jnp.asarray(rng.normal(size=(X, E, S, 2 * r)), jnp.float32)
    bs = [jnp.asarray(rng.normal(size=(X, S, r, F)), jnp.float32) for _ in range(2)]
    kernel = functools.partial(grouped_matmul, interpret=INTERPRET)
    for want, got in zip(expert_lora_deltas(xs, a, bs, sizes, row_expert, row_slot),
                         expert_lora_deltas(xs, a, bs, sizes, row_expert, row_slot, kernel), strict=True):
        np.testing.assert_allclose(np.asarray(got)[:28], np.asarray(want)[:28], atol=1e-4)
    q = QuantizedWeight(jnp.asarray(rng.integers(-127, 128, (X, E, F)), jnp.int8),
                        jnp.asarray(rng.uniform(0.01, 0.02, (X, 1, F)), jnp.float32))
    np.testing.assert_allclose(np.asarray(grouped(xs, q, sizes, row_expert, kernel))[:28],
                               np.asarray(grouped(xs, q, sizes, row_expert))[:28], rtol=1e-5, atol=1e-4)
