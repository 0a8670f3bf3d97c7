"""Writing this step's new K/V rows into the paged KV cache of one layer.

`slot_mapping[t] = page * page_size + offset` names the row that token `t` fills; padding tokens point into
page 0, the reserved scratch page, so their writes land nowhere that matters. This file holds the reference
(an XLA scatter), the Pallas kernel (plain grid, runs in interpret mode on the CPU and lowers through
Triton) and the validating wrapper.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def check_write_kv_args(k_pages, v_pages, k_new, v_new, slot_mapping) -> None:
    """Raise ValueError/TypeError with a specific message when the arguments break the contract."""
    if k_pages.ndim != 4:
        raise ValueError(
            f"k_pages must be [num_pages, page_size, num_kv_heads, head_dim], got {k_pages.shape}"
        )
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages shape {v_pages.shape} differs from k_pages shape {k_pages.shape}")
    _, _, num_kv_heads, head_dim = k_pages.shape
    if k_new.ndim != 3 or k_new.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(f"k_new must be [num_tokens, {num_kv_heads}, {head_dim}], got {k_new.shape}")
    if v_new.shape != k_new.shape:
        raise ValueError(f"v_new shape {v_new.shape} differs from k_new shape {k_new.shape}")
    if slot_mapping.shape != (k_new.shape[0],):
        raise ValueError(
            f"slot_mapping must be [{k_new.shape[0]}] (one slot per token), got {slot_mapping.shape}"
        )
    if slot_mapping.dtype != jnp.int32:
        raise TypeError(f"slot_mapping must be int32, got {slot_mapping.dtype}")
    for name, pages, new in (("k", k_pages, k_new), ("v", v_pages, v_new)):
        if new.dtype != pages.dtype:
            raise TypeError(f"{name}_new dtype {new.dtype} differs from {name}_pages dtype {pages.dtype}")


@jax.jit
def write_kv_reference(k_pages, v_pages, k_new, v_new, slot_mapping):
    """Plain `jax.numpy` KV write: scatter each token's rows to its slot; returns (k_pages, v_pages)."""
    check_write_kv_args(k_pages, v_pages, k_new, v_new, slot_mapping)
    num_pages, page_size, num_kv_heads, head_dim = k_pages.shape
    flat = (num_pages * page_size, num_kv_heads, head_dim)
    k = k_pages.reshape(flat).at[slot_mapping].set(k_new, mode="drop").reshape(k_pages.shape)
    v = v_pages.reshape(flat).at[slot_mapping].set(v_new, mode="drop").reshape(v_pages.shape)
    return k, v


def _write_kv_kernel(
    slots_ref,
    k_new_ref,
    v_new_ref,
    k_in_ref,
    v_in_ref,
    k_out_ref,
    v_out_ref,
    *,
    page_size: int,
    num_kv_heads: int,
):
    """One program: a block of tokens; each head's [block_t, D] rows are scattered to their slots."""
    del k_in_ref, v_in_ref  # aliased to the outputs: only the written slots change
    num_pages = k_out_ref.shape[0]
    slots = slots_ref[...]  # [block_t]
    page = jnp.clip(slots // page_size, 0, num_pages - 1)
    offset = slots % page_size
    # Heads one at a time: each store is a power-of-two [block_t, D] tile, as the Triton lowering needs.
    for h in range(num_kv_heads):
        k_out_ref[page, offset, h, :] = k_new_ref[:, h, :]
        v_out_ref[page, offset, h, :] = v_new_ref[:, h, :]


@functools.partial(jax.jit, static_argnames=("interpret", "block_t"), donate_argnums=(0, 1))
def write_kv(k_pages, v_pages, k_new, v_new, slot_mapping, *, interpret: bool = False, block_t: int = 16):
    """Pallas KV write, in place on the (donated) pages; returns (k_pages, v_pages)."""
    check_write_kv_args(k_pages, v_pages, k_new, v_new, slot_mapping)
    if block_t < 1 or block_t & (block_t - 1):
        raise ValueError(f"block_t must be a positive power of two, got {block_t}")
    num_tokens = k_new.shape[0]
    if num_tokens == 0:
        return k_pages, v_pages
    _, page_size, num_kv_heads, head_dim = k_pages.shape
    if head_dim & (head_dim - 1):
        raise ValueError(f"the Pallas KV write needs a power-of-two head_dim, got {head_dim}")
    block_t = min(block_t, 1 << (num_tokens - 1).bit_length())
    padded = pl.cdiv(num_tokens, block_t) * block_t
    pad = padded - num_tokens
    # Extra tokens write zeros into the scratch page 0, slot 0.
    slots = jnp.pad(slot_mapping, (0, pad))
    k_new = jnp.pad(k_new, ((0, pad), (0, 0), (0, 0)))
    v_new = jnp.pad(v_new, ((0, pad), (0, 0), (0, 0)))

    token_block = pl.BlockSpec((block_t, num_kv_heads, head_dim), lambda i: (i, 0, 0))
    whole = pl.BlockSpec(k_pages.shape, lambda i: (0, 0, 0, 0))
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as pl_triton

        compiler_params = pl_triton.CompilerParams(num_warps=4, num_stages=1)
    return pl.pallas_call(
        functools.partial(_write_kv_kernel, page_size=page_size, num_kv_heads=num_kv_heads),
        grid=(padded // block_t,),
        in_specs=[pl.BlockSpec((block_t,), lambda i: (i,)), token_block, token_block, whole, whole],
        out_specs=(whole, whole),
        out_shape=(
            jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
            jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype),
        ),
        input_output_aliases={3: 0, 4: 1},
        interpret=interpret,
        compiler_params=compiler_params,
        name="write_kv",
    )(slots, k_new, v_new, k_pages, v_pages)
