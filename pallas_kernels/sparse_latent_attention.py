"""Sparse latent attention: DeepSeek Sparse Attention's attention step (DeepSeek-V3.2, GLM-5), each query token over
the page entries its indexer chose.

A page entry is DeepSeek's absorbed MLA entry (`latent_attention.py`): a latent of `value_dim` dims, then a rotary
key, then whatever else the entry carries (the indexer's key: read by the indexer, not here). Every query head of
token t scores the first `key_dim` dims of the entries `slots[kv_head, t, :lens[t]]` (flat indices into the pool,
`page * page_size + offset`) and takes their latents as the values: `[T, QH, value_dim]`. Which entries a token sees
(causality, its top-k) is decided by the caller; a token with `lens` 0 (padding) gets zeros.

Generic Pallas with a plain grid (interpret mode on the CPU; the Triton lowering for NVIDIA GPUs, where each dimension
of a block is a power of two, so the latent and the rotary key are loaded and scored as two blocks). A program is one
query token times a block of its KV head's query heads (64 rows at most by default: DeepSeek-V3.2's 128 heads take two
programs, each gathering the token's entries), over the blocks of its slots of one split (flash-decoding splits for
few tokens); the float32 accumulator is rows x `value_dim` in registers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.latent_attention import (
    LATENT_ROWS,
    LATENT_STAGES,
    as_4d,
    head_block,
    is_pow2,
    latent_block,
    latent_queries,
)
from pallas_kernels.ragged_attention_args import (
    M_FLOOR,
    MMA_MIN_ROWS,
    check_kv_page_dtype,
    combine_splits,
    default_splits,
    next_pow2,
    store_rows,
)
from pallas_kernels.ragged_paged_attention import AttentionTuning


def check_sparse_args(q, pages, slots, lens, key_dim: int, value_dim: int, sm_scale: float) -> None:
    """Raise ValueError/TypeError naming the problem when the arguments break the contract (`pages` 4-D)."""
    if q.ndim != 3:
        raise ValueError(f"q must be [num_tokens, num_q_heads, key_dim], got shape {q.shape}")
    if pages.ndim != 4:
        raise ValueError(f"pages must be [num_pages, page_size, num_kv_heads, width], got {pages.shape}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise TypeError(f"q must be floating point, got {q.dtype}")
    check_kv_page_dtype(pages.dtype, q.dtype)
    num_tokens, num_q_heads, q_dim = q.shape
    num_kv_heads, width = pages.shape[2], pages.shape[3]
    if q_dim != key_dim:
        raise ValueError(f"q's last dim ({q_dim}) must be key_dim ({key_dim})")
    if not 0 < value_dim <= key_dim <= width:
        raise ValueError(f"need 0 < value_dim ({value_dim}) <= key_dim ({key_dim}) <= the entries' width ({width})")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if slots.ndim != 3 or slots.shape[:2] != (num_kv_heads, num_tokens) or slots.dtype != jnp.int32:
        raise ValueError(f"slots must be int32 [{num_kv_heads}, {num_tokens}, topk] (KV heads, tokens, chosen "
                         f"entries), got {slots.dtype} {slots.shape}")
    if lens.shape != (num_tokens,) or lens.dtype != jnp.int32:
        raise ValueError(f"lens must be int32 [{num_tokens}] (one per query token), got {lens.dtype} {lens.shape}")
    if not sm_scale > 0:
        raise ValueError(f"sm_scale must be positive, got {sm_scale}")


def _gather(pages, slots, lens):
    """The chosen entries `[T, KVH, K, W]` and whether each is one of the token's `lens` (`[T, K]`)."""
    num_pages, page_size, num_kv_heads, width = pages.shape
    k = slots.shape[2]
    chosen = jnp.arange(k, dtype=jnp.int32)[None, :] < lens[:, None]  # [T, K]
    flat = jnp.clip(slots, 0, num_pages * page_size - 1)  # [KVH, T, K]
    rows = pages.reshape(num_pages * page_size, num_kv_heads, width)
    entries = rows[flat, jnp.arange(num_kv_heads)[:, None, None]]  # [KVH, T, K, W]
    return entries.transpose(1, 0, 2, 3), chosen


@functools.partial(jax.jit, static_argnames=("key_dim", "value_dim", "sm_scale"))
def sparse_latent_attention_reference(q, pages, slots, lens, *, key_dim: int, value_dim: int,
                                      sm_scale: float) -> jax.Array:
    """The kernel's oracle: each token's softmax over its chosen entries, in float32. `[T, QH, value_dim]`."""
    pages = as_4d(pages)
    check_sparse_args(q, pages, slots, lens, key_dim, value_dim, sm_scale)
    num_tokens, num_q_heads, _ = q.shape
    num_kv_heads = pages.shape[2]
    entries, chosen = _gather(pages, slots, lens)
    entries = jnp.where(chosen[:, None, :, None], entries.astype(jnp.float32), 0.0)  # stale slots: anything
    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, num_q_heads // num_kv_heads, key_dim)
    s = jnp.einsum("tkgd,tkjd->tkgj", qg, entries[..., :key_dim]) * sm_scale
    s = jnp.where(chosen[:, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    denom = p.sum(axis=-1, keepdims=True)
    out = jnp.einsum("tkgj,tkjv->tkgv", p / jnp.where(denom > 0, denom, 1.0), entries[..., :value_dim])
    return out.reshape(num_tokens, num_q_heads, value_dim).astype(q.dtype)


def _sparse_kernel(lens_ref, slots_ref, q_ref, pages_ref, *out_refs, head_blocks: int, value_dim: int, block_kv: int,
                   sm_scale: float, num_splits: int, use_mma: bool):
    """One program: one query token, `rows` of its KV head's query heads, over the blocks of one split of its
    chosen entries."""
    t, virtual_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kv_head = virtual_head // head_blocks
    num_pages, page_size = pages_ref.shape[0], pages_ref.shape[1]
    count = lens_ref[t]
    num_blocks = pl.cdiv(count, block_kv)
    per_split = pl.cdiv(num_blocks, num_splits)
    start = split * per_split
    stop = jnp.minimum(num_blocks, start + per_split)

    q = latent_queries(q_ref, value_dim, use_mma)

    def body(j, carry):
        chosen = j * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv,), 0) < count  # [block_kv]
        flat = jnp.clip(slots_ref[pl.ds(j * block_kv, block_kv)], 0, num_pages * page_size - 1)
        return latent_block(carry, q, pages_ref, flat // page_size, flat % page_size, kv_head, chosen[None, :], chosen,
                            sm_scale=sm_scale, use_mma=use_mma)

    rows = q_ref.shape[0]
    init = (jnp.zeros((rows, value_dim), jnp.float32), jnp.full((rows,), M_FLOOR, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    acc, m, denom = lax.fori_loop(start, stop, body, init)
    store_rows(out_refs, acc, m, denom, num_splits)


@functools.partial(jax.jit, static_argnames=("key_dim", "value_dim", "sm_scale", "interpret", "tuning"))
def sparse_latent_attention(q, pages, slots, lens, *, key_dim: int, value_dim: int, sm_scale: float,
                            interpret: bool = False, tuning: AttentionTuning = AttentionTuning()) -> jax.Array:
    """Pallas sparse latent attention; `[T, QH, value_dim]` in q's dtype. q `[T, QH, key_dim]` (absorbed queries:
    latent dims, then rotary ones); pages `[N, page_size, KVH, W]` (or `[N, page_size, W]` for one KV head), their
    entries' first `key_dim` dims the keys, the first `value_dim` the values; slots `[KVH, T, K]` int32: the entries
    each token attends (flat indices), the first `lens[t]` of them (`lens` `[T]` int32) chosen. `tuning.latent_heads`,
    `block_kv`, `num_kv_splits`, `num_warps` and `num_stages` override the defaults."""
    pages = as_4d(pages)
    check_sparse_args(q, pages, slots, lens, key_dim, value_dim, sm_scale)
    num_tokens, num_q_heads, _ = q.shape
    num_kv_heads = pages.shape[2]
    rope_dim = key_dim - value_dim
    if not is_pow2(value_dim) or (rope_dim and not is_pow2(rope_dim)):
        raise ValueError(f"the sparse latent attention kernel needs power-of-two latent and rotary dims, got "
                         f"{value_dim} + {rope_dim}")
    if num_tokens == 0:
        return jnp.zeros((0, num_q_heads, value_dim), q.dtype)
    group = num_q_heads // num_kv_heads
    heads = head_block(group, tuning.latent_heads or LATENT_ROWS)
    rows = next_pow2(heads)
    pad_rows = tuning.pad_rows_to_mma
    if pad_rows is None:  # tensor-core dots for 16-bit queries when compiled
        pad_rows = not interpret and jnp.dtype(q.dtype).itemsize == 2
    use_mma = rows >= MMA_MIN_ROWS or pad_rows
    rows = max(rows, MMA_MIN_ROWS) if use_mma else rows
    block_kv = tuning.block_kv or (32 if use_mma else 16)
    virtual = num_kv_heads * (group // heads)  # programs per token: each KV head's heads, `heads` at a time
    topk = slots.shape[2]
    splits = tuning.num_kv_splits or default_splits(num_tokens, virtual, topk, block_kv)

    # Slots padded to a power of two of whole blocks (the padding is past every count); q as
    # [T, virtual, rows, key_dim].
    slots = jnp.pad(slots, ((0, 0), (0, 0), (0, max(next_pow2(topk), block_kv) - topk)))
    qb = q.reshape(num_tokens, virtual, heads, key_dim)
    qb = jnp.pad(qb, ((0, 0), (0, 0), (0, rows - heads), (0, 0)))
    head_blocks = group // heads
    kernel = functools.partial(_sparse_kernel, head_blocks=head_blocks, value_dim=value_dim, block_kv=block_kv, sm_scale=float(sm_scale), num_splits=splits, use_mma=use_mma)
    in_specs = [
        pl.BlockSpec(lens.shape, lambda t, h, k: (0,)),
        pl.BlockSpec((None, None, slots.shape[2]), lambda t, h, k: (h // head_blocks, t, 0)),
        pl.BlockSpec((None, None, rows, key_dim), lambda t, h, k: (t, h, 0, 0)),
        pl.BlockSpec(pages.shape, lambda t, h, k: (0, 0, 0, 0)),  # whole: entries are gathered inside
    ]
    tile = (num_tokens, virtual, rows)
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct((*tile, value_dim), q.dtype)
        out_specs = pl.BlockSpec((None, None, rows, value_dim), lambda t, h, k: (t, h, 0, 0))
    else:
        out_shape = (jax.ShapeDtypeStruct((splits, *tile, value_dim), jnp.float32),
                     jax.ShapeDtypeStruct((splits, *tile), jnp.float32),
                     jax.ShapeDtypeStruct((splits, *tile), jnp.float32))
        out_specs = (pl.BlockSpec((None, None, None, rows, value_dim), lambda t, h, k: (k, t, h, 0, 0)),
                     pl.BlockSpec((None, None, None, rows), lambda t, h, k: (k, t, h, 0)),
                     pl.BlockSpec((None, None, None, rows), lambda t, h, k: (k, t, h, 0)))
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as pl_triton

        num_warps = tuning.num_warps or (8 if rows >= 32 else 4)
        params = pl_triton.CompilerParams(num_warps=num_warps, num_stages=tuning.num_stages or LATENT_STAGES)
    result = pl.pallas_call(
        kernel, grid=(num_tokens, virtual, splits), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        interpret=interpret, compiler_params=params,
        name=f"sparse_latent_attention_h{heads}_bkv{block_kv}_s{splits}",
    )(lens, slots, qb, pages)
    ob = result if splits == 1 else combine_splits(*result)  # [T, virtual, rows, value_dim]
    return ob[:, :, :heads].reshape(num_tokens, num_q_heads, value_dim).astype(q.dtype)
