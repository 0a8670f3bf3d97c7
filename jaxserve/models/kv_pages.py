"""The page pool's storage: how the CPU keeps narrow pages, reading pages back, writing new tokens' K and V."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_attention_args import quantize_kv


def kv_storage_bits(dtype) -> jnp.dtype | None:
    """The unsigned integer type the CPU attention keeps pages of `dtype` in during a step (None for
    float32). XLA:CPU has no bfloat16 or float8 gather or scatter: around one it upcasts the whole pool
    of the layer to float32 and back. Measured, 16 decode rows at 1.5k context over a 2048-page pool:
    14.6 s a step in bfloat16 and 33.7 s in float8_e4m3fn, against 0.45 s in float32."""
    dtype = jnp.dtype(dtype)
    return None if dtype.itemsize >= 4 else jnp.dtype(f"uint{8 * dtype.itemsize}")


def read_pages(pool: jax.Array, pages: jax.Array, kv_dtype) -> jax.Array:
    """The given pages of a pool in float32; a pool of raw bits is gathered as integers, then read as
    `kv_dtype`."""
    block = pool[pages]
    if kv_dtype is not None and block.dtype != kv_dtype:
        block = jax.lax.bitcast_convert_type(block, kv_dtype)
    return block.astype(jnp.float32)


def write_kv(
    k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array, kv_dtype=None
) -> tuple[jax.Array, jax.Array]:
    """Scatter new K/V ([T, Hkv, D]) into their slots (page * page_size + offset), as `kv_dtype` (float8
    saturates; see `quantize_kv`) or the pages' dtype. Pools of raw bits (`kv_storage_bits`) get the bits; a pool
    of one KV head may come without its head axis ([N, page_size, D]); an empty one is left as it is."""
    n, page_size = k_pages.shape[:2]
    if k.shape[0] == 1:
        # XLA turns a one-row scatter into a dynamic-update-slice, which XLA:CPU does not always do
        # in place in an unrolled layer loop (it copied the whole pool per layer); a second row
        # aimed at slot 0 of the reserved padding page keeps it a scatter.
        k, v = jnp.pad(k, ((0, 1), (0, 0), (0, 0))), jnp.pad(v, ((0, 1), (0, 0), (0, 0)))
        slot_mapping = jnp.pad(slot_mapping, (0, 1))

    def rows(x, pool):
        x = quantize_kv(x, kv_dtype or pool.dtype)
        return x if x.dtype == pool.dtype else jax.lax.bitcast_convert_type(x, pool.dtype)

    def scatter(pool, x):  # (a pool of [N, page_size, D]: one KV head, its axis dropped)
        if pool.size == 0:  # (an MLA model's values: none)
            return pool
        slot = pool.shape[2:]
        return pool.reshape(n * page_size, *slot).at[slot_mapping].set(rows(x, pool).reshape(-1, *slot)).reshape(
            pool.shape)

    return scatter(k_pages, k), scatter(v_pages, v)
