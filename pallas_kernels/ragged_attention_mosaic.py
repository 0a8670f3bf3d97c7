"""Ragged paged attention on Mosaic GPU (Hopper): prefill chunks and decode tokens of many sequences in one call.

The kernel of `paged_decode_mosaic.py` over query blocks instead of single tokens: each sequence's query tokens
are cut into blocks of `64 // group` consecutive tokens, and a block with the `group` query heads of one KV head
fills the 64 rows of a WGMMA tile (GQA shares each K/V block among the group's heads and the block's tokens).
A program walks the KV blocks up to its last token's position, causal within the block by a per-row mask, the
same double-buffered TMA page gather, tensor-core products and float32 online softmax as for decode; float8
pages are upcast in SMEM. No flash-decoding split (a prefill has programs enough); no soft-cap or sliding window
(those calls stay on the generic kernel of `ragged_paged_attention.py`).

Which kernel serves prefill on Hopper is a measurement (`bench/gpu_kernels.py` times both); this one is
checked in Mosaic GPU's CPU interpreter against the float64 oracle and compiled for sm_90 without a GPU.
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels.paged_decode_mosaic import ROWS, check_mosaic_args, mosaic_attention_blocks
from pallas_kernels.ragged_attention_args import (
    block_layout,
    blocks_to_tokens,
    check_attention_args,
    queries_to_blocks,
)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_kv", "interpret"))
def ragged_paged_attention_mosaic(
    q,
    k_pages,
    v_pages,
    block_tables,
    seq_lens,
    query_start_loc,
    *,
    sm_scale: float,
    block_kv: int = 64,
    interpret: bool = False,
) -> jax.Array:
    """Ragged paged attention (the contract of `ragged_paged_attention`, no soft-cap or window) on Mosaic
    GPU: q `[T, QH, D]` bfloat16 or float16, pages of q's dtype or float8 -> `[T, QH, D]` in q's dtype."""
    check_attention_args(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, sm_scale, None, None)
    group = check_mosaic_args(q, k_pages, v_pages, block_tables, block_kv)
    num_tokens = q.shape[0]
    num_kv_heads = k_pages.shape[2]
    block_q = ROWS // group
    _, meta, gather_tok, tok_block, tok_row, tok_valid = block_layout(seq_lens, query_start_loc, num_tokens,
                                                                     block_q)
    qb = queries_to_blocks(q, gather_tok, num_kv_heads, ROWS)  # [NB, KVH, ROWS, D]
    ob = mosaic_attention_blocks(qb, meta, k_pages, v_pages, block_tables, sm_scale=sm_scale, block_kv=block_kv,
                                 splits=1, group=group, interpret=interpret,
                                 name=f"ragged_attention_mosaic_bq{block_q}_bkv{block_kv}")
    return blocks_to_tokens(ob, tok_block, tok_row, tok_valid, block_q, group).astype(q.dtype)
