"""Ragged paged attention on Mosaic GPU (Hopper): prefill chunks and decode tokens of many sequences in one call.

Each sequence's query tokens are cut into blocks, and a block with the `group` query heads of one KV head fills
the rows of WGMMA tiles (GQA shares each K/V block among the group's heads and the block's tokens; row r is
token r // group). A block walks the KV blocks up to its last token's position, causal by a per-row mask; K/V
pages arrive by TMA through the block table into SMEM, the products run on the tensor cores into float32
accumulators, and the softmax is online in float32. The one-warpgroup form can split each block's walk over the
KV (flash decoding), for a short step over long contexts (drafts verified as chunks); the other cannot.
The optional logit soft-cap, sliding window, chunks and attention sinks are those of the generic kernel; with a
window (or chunks) a block walks only the KV blocks its tokens' windows (chunks) reach, and each row's sink logit joins its softmax sum
(in the warp-specialized form at the end of the walk, in the other where the partials are combined).

Two forms:
- `compute_wgs=2`, warp-specialized (`ragged_mosaic_ws.py`; the default when compiled): three warpgroups. Two
  compute warpgroups take 64 rows each (a block of `128 // group` tokens) and share every K/V block, which
  doubles the FLOPs per byte moved into SMEM; the third issues the page copies into a two-stage ring, and
  refills a stage when both compute warpgroups have released it. The compute warpgroups take turns on the
  tensor cores (one's softmax runs during the other's products), and the blocks that need no causal mask
  skip it. Float8 pages land by TMA in a ring of their own, and the loading warpgroup upcasts each block into
  the stage the tensor cores read (64 x 128 elements at a time; the loader then takes 80 registers a thread, the
  compute warpgroups 216).
- `compute_wgs=1`: the one-warpgroup body of `paged_decode_mosaic.py` over blocks of `64 // group` tokens
  (float8 pages upcast by the same warpgroup that multiplies them).

Which kernel serves prefill on Hopper is a measurement (`bench/gpu_kernels.py` times them all); both forms
are checked in Mosaic GPU's CPU interpreter against the float64 oracle and compiled for sm_90 without a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.paged_decode_mosaic import ROWS, check_mosaic_args, mosaic_attention_blocks
from pallas_kernels.ragged_attention_args import (
    block_layout,
    block_spans,
    block_splits,
    blocks_to_tokens,
    check_attention_args,
    clamp_last_key,
    key_capacity,
    queries_to_blocks,
)
from pallas_kernels.ragged_mosaic_form import (  # noqa: F401 (re-exported: the backend and the tests read them)
    COMPUTE_WGS,
    STAGES,
    kernel_form,
    ragged_mosaic_supported,
    ws_block_kv,
    ws_smem_bytes,
)
from pallas_kernels.ragged_mosaic_ws import ws_attention_blocks


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window", "attention_chunk", "block_kv",
                                             "compute_wgs", "num_splits", "interpret"))
def ragged_paged_attention_mosaic(
    q,
    k_pages,
    v_pages,
    block_tables,
    seq_lens,
    query_start_loc,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    block_kv: int | None = None,
    compute_wgs: int | None = None,
    num_splits: int | None = None,
    interpret: bool = False,
    skip_seqs: jax.Array | None = None,
    last_key: jax.Array | None = None,
    sinks: jax.Array | None = None,
    attention_chunk: int | None = None,
) -> jax.Array:
    """Ragged paged attention (the contract of `ragged_paged_attention`) on Mosaic GPU: q `[T, QH, D]`
    bfloat16 or float16, pages of q's dtype or float8 -> `[T, QH, D]` in q's dtype.

    `compute_wgs`: 2 (warp-specialized) or 1; None picks 2 when compiled, 1 in the interpreter.
    `block_kv`: keys per KV block; None picks 128 for the warp-specialized form where it fits, else 64.
    `num_splits` (one warpgroup only): splits of each block's KV walk; None picks them by the blocks, the
    sequences and the page table's width (`block_splits`) when compiled, 1 in the interpreter.
    `skip_seqs` (`[S]` bool): sequences left out (no programs; their tokens come back zero), for a caller that
    attends them elsewhere, as `ragged_paged_attention` does a mixed batch's decode tokens.
    `last_key`: spans attended both ways (the contract's); a batch where a query block meets more than
    `BLOCK_SPANS` of them goes to the generic kernel whole. `sinks` `[QH]`: each head's attention-sink logit
    (gpt-oss), in the softmax's sum and carrying no value. `attention_chunk`: Llama 4's chunked attention."""
    check_attention_args(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, sm_scale, soft_cap,
                         sliding_window, last_key, sinks, attention_chunk)
    if compute_wgs is not None and compute_wgs not in (1, COMPUTE_WGS):
        raise ValueError(f"compute_wgs must be 1 or {COMPUTE_WGS}, got {compute_wgs}")
    if num_splits is not None and (num_splits < 1 or (num_splits > 1 and compute_wgs != 1)):
        raise ValueError(f"num_splits must be a positive count, and above 1 only with compute_wgs=1, got {num_splits}")
    head_dim, page_size = q.shape[2], k_pages.shape[1]
    compute_wgs, block_kv, smem = kernel_form(q.dtype, k_pages.dtype, head_dim, page_size, interpret, compute_wgs,
                                        block_kv)
    group = check_mosaic_args(q, k_pages, v_pages, block_tables, block_kv, smem=smem)
    num_tokens = q.shape[0]
    num_kv_heads = k_pages.shape[2]
    rows = compute_wgs * ROWS
    block_q = rows // group
    if skip_seqs is not None and (skip_seqs.shape != seq_lens.shape or skip_seqs.dtype != jnp.bool_):
        raise ValueError(f"skip_seqs must be bool [{seq_lens.shape[0]}] (one per sequence), got "
                         f"{skip_seqs.dtype} {skip_seqs.shape}")
    _, meta, gather_tok, tok_block, tok_row, tok_valid = block_layout(seq_lens, query_start_loc, num_tokens,
                                                                     block_q, skip=skip_seqs)
    qb = queries_to_blocks(q, gather_tok, num_kv_heads, rows)  # [NB, KVH, rows, D]
    over = None
    if last_key is not None:
        last_key = clamp_last_key(last_key, seq_lens, query_start_loc, num_tokens)
        spans, over = block_spans(last_key, seq_lens, query_start_loc, gather_tok, meta)
        meta = jnp.concatenate([meta, spans], axis=1)  # [NB, 8]
    # Row r of a block holds query head r % group of its KV head: one sink logit per row ([KVH, rows]).
    sink_rows = None if sinks is None else jnp.pad(
        jnp.tile(sinks.astype(jnp.float32).reshape(num_kv_heads, group), (1, block_q)),
        ((0, 0), (0, rows - block_q * group)))

    def mosaic():
        if compute_wgs == 1:
            # A window or a chunk bounds the keys any block reads.
            capacity = key_capacity(block_tables.shape[1] * page_size, sliding_window, attention_chunk, block_q,
                                    block_kv)
            splits = num_splits or (1 if interpret else block_splits(
                qb.shape[0], seq_lens.shape[0], num_kv_heads, capacity, block_kv, ROWS, head_dim,
                k_pages.dtype.itemsize))
            ob = mosaic_attention_blocks(qb, meta, k_pages, v_pages, block_tables, sm_scale=sm_scale,
                                         block_kv=block_kv, splits=splits, group=group, interpret=interpret,
                                         soft_cap=soft_cap, window=sliding_window, chunk=attention_chunk,
                                         sinks=sink_rows,
                                         name=f"ragged_attention_mosaic_bq{block_q}_bkv{block_kv}_s{splits}")
        else:
            num_blocks = qb.shape[0]
            ob = ws_attention_blocks(qb.reshape(num_blocks, num_kv_heads, COMPUTE_WGS, ROWS, head_dim), meta,
                                     k_pages, v_pages, block_tables, sm_scale=sm_scale, soft_cap=soft_cap,
                                     window=sliding_window, chunk=attention_chunk, block_kv=block_kv, group=group, interpret=interpret,
                                     sinks=sink_rows, name=f"ragged_attention_mosaic_ws_bq{block_q}_bkv{block_kv}")
            ob = ob.reshape(num_blocks, num_kv_heads, rows, head_dim)
        return blocks_to_tokens(ob, tok_block, tok_row, tok_valid, block_q, group).astype(q.dtype)

    if over is None:
        return mosaic()
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention

    def generic():  # a block meeting more spans than its metadata holds: the whole batch on the generic kernel
        return ragged_paged_attention(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc,
                                      sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
                                      attention_chunk=attention_chunk, last_key=last_key, sinks=sinks, interpret=interpret)

    return lax.cond(over, generic, mosaic)
