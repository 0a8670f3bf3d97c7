"""Paged latent attention: DeepSeek's multi-head latent attention in its absorbed form, over pages of one entry per
token shared by a group of query heads.

A page entry is `head_dim` wide: a latent of `value_dim` dims, then a rotary key (`head_dim - value_dim`; 512 + 64
in DeepSeek-V2 / -V3). Every query head scores the whole entry and takes its latent as the value, so the output is
`[T, QH, value_dim]`: multi-query attention whose values are the keys' first dims, read once. The queries, the
ragged layout, causality and the flash-decoding splits are those of `ragged_paged_attention`; no soft cap, sliding
window, spans or sinks (no latent-attention model has them).

The kernel is generic Pallas with a plain grid (interpret mode on the CPU; the Triton lowering for NVIDIA GPUs,
where each dimension of a block must be a power of two, so the latent and the rotary part are loaded and scored as
two blocks). A program holds one block of query tokens of one sequence times a block of its group's heads: the
float32 accumulator is rows x `value_dim` (64 x 512 at most by default, in registers), so DeepSeek-V3's 128 heads
per entry take two programs, each reading the pages.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.ragged_attention_args import (
    M_FLOOR,
    block_layout,
    blocks_to_tokens,
    check_attention_args,
    combine_splits,
    default_splits,
    logits,
    next_pow2,
    queries_to_blocks,
    row_tiling,
    store_rows,
)
from pallas_kernels.ragged_attention_reference import ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention import AttentionTuning

# Query rows (tokens x heads) a program holds at most, unless `AttentionTuning.latent_heads` says otherwise.
LATENT_ROWS = 64
# Triton's pipelining stages: 3 beat 2 in every row measured on an H200 (decode at 8k context: V2-Lite's 16 heads
# 294 against 400 us at 32 sequences, 768 against 809 at 128; V3's 128 heads 702 against 736 at 32).
LATENT_STAGES = 3


def is_pow2(n: int) -> bool:
    return n > 0 and not n & (n - 1)


def check_latent_args(q, pages, block_tables, seq_lens, query_start_loc, value_dim, sm_scale) -> None:
    """Raise ValueError/TypeError naming the problem when the arguments break the contract (`pages` 4-D)."""
    check_attention_args(q, pages, pages, block_tables, seq_lens, query_start_loc, sm_scale, None, None)
    head_dim = q.shape[2]
    if not 0 < value_dim <= head_dim:
        raise ValueError(f"value_dim must be in 1..head_dim ({head_dim}), got {value_dim}")


def as_4d(pages: jax.Array) -> jax.Array:
    """Pages of one entry per token, with or without their axis of KV heads (a pool of one drops it)."""
    if pages.ndim == 3:
        return pages[:, :, None, :]
    return pages


@functools.partial(jax.jit, static_argnames=("value_dim", "sm_scale"))
def latent_paged_attention_reference(q, pages, block_tables, seq_lens, query_start_loc, *, value_dim: int,
                                     sm_scale: float) -> jax.Array:
    """The kernel's oracle: ragged paged attention with the pages as both keys and values, cut to the latent."""
    pages = as_4d(pages)
    check_latent_args(q, pages, block_tables, seq_lens, query_start_loc, value_dim, sm_scale)
    out = ragged_paged_attention_reference(q, pages, pages, block_tables, seq_lens, query_start_loc,
                                           sm_scale=sm_scale)
    return out[..., :value_dim]


def _latent_kernel(meta_ref, block_tables_ref, q_ref, pages_ref, *out_refs, heads: int, head_blocks: int,
                   value_dim: int, block_kv: int, page_size: int, sm_scale: float, num_splits: int, use_mma: bool):
    """One program: one block of query tokens of one sequence, `heads` query heads of one entry's group (row r:
    token r // heads), over KV blocks of one split."""
    b, virtual_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kv_head = virtual_head // head_blocks
    num_pages, pages_per_seq = pages_ref.shape[0], block_tables_ref.shape[1]
    rows = q_ref.shape[0]
    seq, pos0, num_q = meta_ref[b, 0], meta_ref[b, 1], meta_ref[b, 2]

    row_q = lax.broadcasted_iota(jnp.int32, (rows,), 0) // heads
    row_pos = pos0 + row_q
    row_valid = row_q < num_q
    kv_hi = jnp.where(num_q > 0, pos0 + num_q, 0)  # the block's last real query sees KV positions < kv_hi
    num_blocks = pl.cdiv(kv_hi, block_kv)
    per_split = pl.cdiv(num_blocks, num_splits)
    start = split * per_split
    stop = jnp.minimum(num_blocks, start + per_split)

    q = latent_queries(q_ref, value_dim, use_mma)

    def body(j, carry):
        kv_pos = j * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv,), 0)
        slot = jnp.minimum(kv_pos // page_size, pages_per_seq - 1)
        page = jnp.clip(block_tables_ref[seq, slot], 0, num_pages - 1)
        seen = (kv_pos[None, :] <= row_pos[:, None]) & row_valid[:, None]
        # Stale pages may hold anything; zero the values past the sequence so 0 * garbage cannot poison the sum.
        return latent_block(carry, q, pages_ref, page, kv_pos % page_size, kv_head, seen, kv_pos < kv_hi,
                            sm_scale=sm_scale, use_mma=use_mma)

    init = (jnp.zeros((rows, value_dim), jnp.float32), jnp.full((rows,), M_FLOOR, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    acc, m, denom = lax.fori_loop(start, stop, body, init)
    store_rows(out_refs, acc, m, denom, num_splits)


def latent_queries(q_ref, value_dim: int, use_mma: bool) -> tuple:
    """A program's queries as (latent dims [rows, R], rotary dims [rows, Dr] or None), float32 off the tensor cores."""
    rope_dim = q_ref.shape[1] - value_dim
    q_latent = q_ref[:, pl.ds(0, value_dim)]
    q_rope = q_ref[:, pl.ds(value_dim, rope_dim)] if rope_dim else None
    if not use_mma:
        q_latent = q_latent.astype(jnp.float32)
        q_rope = None if q_rope is None else q_rope.astype(jnp.float32)
    return q_latent, q_rope


def latent_block(carry, q, pages_ref, page, offset, kv_head, seen, keep, *, sm_scale: float, use_mma: bool):
    """The online softmax `carry` (acc [rows, R], row max, row sum) with one block of entries folded in: entry i at
    `pages_ref[page[i], offset[i], kv_head]` scored by the queries `q` (`latent_queries`) where `seen` [rows, block]
    says, its latent the value where `keep` [block] says (elsewhere zero: a stale entry may hold anything)."""
    acc, m_prev, l_prev = carry
    q_latent, q_rope = q
    value_dim = q_latent.shape[1]

    def score(qp, kp):
        if use_mma:
            return lax.dot_general(qp, kp.astype(qp.dtype), (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)
        return jnp.sum(qp[:, None, :] * kp.astype(jnp.float32)[None, :, :], axis=-1)

    latent = pages_ref[page, offset, kv_head, pl.ds(0, value_dim)]  # [block, R]: keys and values
    s = score(q_latent, latent)
    if q_rope is not None:
        s = s + score(q_rope, pages_ref[page, offset, kv_head, pl.ds(value_dim, q_rope.shape[1])])
    s = jnp.where(seen, logits(s, sm_scale, None), -jnp.inf)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.exp(s - m_next[:, None])
    l_next = alpha * l_prev + jnp.sum(p, axis=1)
    values = jnp.where(keep[:, None], latent, jnp.zeros_like(latent))
    if use_mma:
        pv = jnp.dot(p.astype(q_latent.dtype), values.astype(q_latent.dtype), preferred_element_type=jnp.float32)
    else:
        pv = jnp.sum(p[:, :, None] * values.astype(jnp.float32)[None, :, :], axis=1)
    return acc * alpha[:, None] + pv, m_next, l_next


def head_block(group: int, cap: int) -> int:
    """The most heads of a group a program takes: the largest divisor of `group` not above `cap`."""
    return max(d for d in range(1, min(group, cap) + 1) if group % d == 0)


def latent_tuning(tuning: AttentionTuning, num_tokens: int, num_seqs: int, num_kv_heads: int, group: int,
                  kv_capacity: int, head_dim: int, value_dim: int, kv_itemsize: int) -> dict:
    """The kernel's static blocking for these shapes: heads and query tokens per program, rows, tensor-core dots,
    KV block, splits and warps."""
    heads = head_block(group, tuning.latent_heads or LATENT_ROWS)
    block_q = tuning.block_q or max(1, min(16, next_pow2(pl.cdiv(num_tokens, num_seqs)),
                                           (tuning.latent_heads or LATENT_ROWS) // next_pow2(heads)))
    rows, use_mma, num_blocks = row_tiling(block_q, heads, bool(tuning.pad_rows_to_mma), num_tokens, num_seqs)
    block_kv = tuning.block_kv or (32 if use_mma else 16)
    programs = num_kv_heads * (group // heads)
    splits = tuning.num_kv_splits
    if splits is None:
        splits = default_splits(num_blocks, programs, kv_capacity, block_kv)
        # Halved while the float32 partials would pass a quarter of the entries the sequences can hold.
        entries = num_seqs * kv_capacity * num_kv_heads * head_dim * kv_itemsize
        while splits > 1 and splits * num_blocks * programs * rows * value_dim * 4 * 4 > entries:
            splits //= 2
    num_warps = tuning.num_warps or (8 if rows >= 32 else 4)
    return dict(heads=heads, block_q=block_q, rows=rows, use_mma=use_mma, block_kv=block_kv, splits=splits,
                num_warps=num_warps)


@functools.partial(jax.jit, static_argnames=("value_dim", "sm_scale", "interpret", "tuning"))
def latent_paged_attention(q, pages, block_tables, seq_lens, query_start_loc, *, value_dim: int, sm_scale: float,
                           interpret: bool = False, tuning: AttentionTuning = AttentionTuning()) -> jax.Array:
    """Pallas paged latent attention; `[T, QH, value_dim]` in q's dtype. q `[T, QH, head_dim]` (the absorbed
    queries: latent dims, then rotary ones); pages `[N, page_size, KVH, head_dim]`, or `[N, page_size, head_dim]`
    for one KV head; the rest as `ragged_paged_attention`."""
    pages = as_4d(pages)
    check_latent_args(q, pages, block_tables, seq_lens, query_start_loc, value_dim, sm_scale)
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = pages.shape
    num_seqs, pages_per_seq = block_tables.shape
    rope_dim = head_dim - value_dim
    if not is_pow2(value_dim) or (rope_dim and not is_pow2(rope_dim)):
        raise ValueError(f"the latent attention kernel needs power-of-two latent and rotary dims, got {value_dim} + "
                         f"{rope_dim}")
    if num_tokens == 0:
        return jnp.zeros((0, num_q_heads, value_dim), q.dtype)
    group = num_q_heads // num_kv_heads
    t = latent_tuning(tuning, num_tokens, num_seqs, num_kv_heads, group, pages_per_seq * page_size, head_dim,
                      value_dim, pages.dtype.itemsize)
    heads, rows, splits = t["heads"], t["rows"], t["splits"]
    virtual = num_kv_heads * (group // heads)  # programs per query block: each KV head's heads, `heads` at a time
    num_blocks, meta, gather_tok, tok_block, tok_row, tok_valid = block_layout(
        seq_lens, query_start_loc, num_tokens, t["block_q"])
    qb = queries_to_blocks(q, gather_tok, virtual, rows)  # [NB, virtual, rows, D]

    kernel = functools.partial(
        _latent_kernel, heads=heads, head_blocks=group // heads, value_dim=value_dim, block_kv=t["block_kv"],
        page_size=page_size, sm_scale=float(sm_scale), num_splits=splits, use_mma=t["use_mma"])
    in_specs = [
        pl.BlockSpec(meta.shape, lambda b, h, k: (0, 0)),
        pl.BlockSpec(block_tables.shape, lambda b, h, k: (0, 0)),
        pl.BlockSpec((None, None, rows, head_dim), lambda b, h, k: (b, h, 0, 0)),
        pl.BlockSpec(pages.shape, lambda b, h, k: (0, 0, 0, 0)),  # whole: pages are gathered inside
    ]
    tile = (num_blocks, virtual, rows)
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct((*tile, value_dim), q.dtype)
        out_specs = pl.BlockSpec((None, None, rows, value_dim), lambda b, h, k: (b, h, 0, 0))
    else:
        out_shape = (jax.ShapeDtypeStruct((splits, *tile, value_dim), jnp.float32),
                     jax.ShapeDtypeStruct((splits, *tile), jnp.float32),
                     jax.ShapeDtypeStruct((splits, *tile), jnp.float32))
        out_specs = (pl.BlockSpec((None, None, None, rows, value_dim), lambda b, h, k: (k, b, h, 0, 0)),
                     pl.BlockSpec((None, None, None, rows), lambda b, h, k: (k, b, h, 0)),
                     pl.BlockSpec((None, None, None, rows), lambda b, h, k: (k, b, h, 0)))
    if interpret:
        params = None
    else:
        from jax.experimental.pallas import triton as pl_triton

        params = pl_triton.CompilerParams(num_warps=t["num_warps"], num_stages=tuning.num_stages or LATENT_STAGES)
    result = pl.pallas_call(
        kernel, grid=(num_blocks, virtual, splits), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        interpret=interpret, compiler_params=params,
        name=f"latent_paged_attention_bq{t['block_q']}_h{heads}_bkv{t['block_kv']}_s{splits}",
    )(meta, block_tables, qb, pages)
    ob = result if splits == 1 else combine_splits(*result)
    return blocks_to_tokens(ob, tok_block, tok_row, tok_valid, t["block_q"], heads).astype(q.dtype)
