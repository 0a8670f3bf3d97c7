"""Ragged paged attention: prefill chunks and decode tokens of many sequences in one call.

The KV cache of one layer is a pool of pages `[num_pages, page_size, num_kv_heads, head_dim]`; page 0 is a reserved
scratch page. Query tokens are packed by sequence. Query token `i` of sequence `s` sits at position `seq_lens[s] -
q_len[s] + i` and attends causally to KV positions up to its own, or up to `last_key[t]` where given (a span attended
both ways; the last `sliding_window` positions with a window; none before its chunk of `attention_chunk` positions).
Softmax runs in float32. Pages stored narrower than q (float8, bfloat16) are upcast block by block as they load.

This file holds the Pallas kernel (generic Pallas with a plain grid, so it runs with `interpret=True` on the
CPU and lowers for NVIDIA GPUs through Triton), its tuning and the wrapper; the argument checks are in
`ragged_attention_args.py` and the plain `jax.numpy` reference in `ragged_attention_reference.py`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.ragged_attention_args import (
    M_FLOOR,
    alibi_bias,
    block_layout,
    blocks_to_tokens,
    check_attention_args,
    clamp_last_key,
    combine_splits,
    head_pieces,
    logits,
    mask_keys,
    next_pow2,
    queries_to_blocks,
    row_tiling,
    store_rows,
    token_metadata,
    window_start,
)
from pallas_kernels.ragged_attention_reference import ragged_paged_attention_reference

# Re-exported: the backend switch and the tests import the reference and the checks from here.
__all__ = ["AttentionTuning", "check_attention_args", "ragged_paged_attention", "ragged_paged_attention_reference"]

_TARGET_PROGRAMS = 2 * 132  # the split heuristic aims at a couple of programs per SM (Hopper has 132)


@dataclasses.dataclass(frozen=True)
class AttentionTuning:
    """Static block sizes of the Pallas kernel; `None` picks a default from the input shapes."""

    block_q: int | None = None  # query tokens per program (power of two)
    block_kv: int | None = None  # KV tokens per inner step (power of two, independent of page size)
    num_kv_splits: int | None = None  # flash-decoding partitions of the KV length
    # Pad tiny head groups to 16 rows and use tensor-core dots. None: where compiled with 16-bit queries (decode
    # rows on an H200 at 8k contexts: 2371 against 417 us with Llama-3-8B's heads at 32 sequences, 486 against
    # 429 with SmolLM2's; its probabilities meet V in q's dtype), not in the interpreter or for float32. (The
    # latent kernel, not measured so, reads None as False.)
    pad_rows_to_mma: bool | None = None
    num_warps: int | None = None
    num_stages: int | None = None  # Triton's pipelining stages (None: 2; the latent kernel 3)
    # "mosaic": batches of one query token per sequence to the Mosaic GPU decode kernel (paged_decode_mosaic.py),
    # batches with prefill chunks to the ragged one (ragged_attention_mosaic.py), where they take the shapes.
    decode_lowering: str = "triton"
    prefill_lowering: str = "triton"
    # With both lowerings "mosaic": in a batch holding prefill chunks, the decode tokens (sequences of one
    # query token) go to the decode kernel (flash-decoding splits, a 64-row tile) and only the chunks to the
    # ragged kernel, two calls in one step; False sends the whole batch to the ragged kernel.
    split_mixed: bool = True
    # The latent attention kernel (latent_attention.py): query heads a program takes at most (None: 64 rows).
    latent_heads: int | None = None

    def __post_init__(self):
        for name in ("block_q", "block_kv", "num_kv_splits"):
            v = getattr(self, name)
            if v is not None and (v < 1 or v & (v - 1)):
                raise ValueError(f"AttentionTuning.{name} must be a positive power of two, got {v}")
        if self.latent_heads is not None and self.latent_heads < 1:
            raise ValueError(f"AttentionTuning.latent_heads must be positive, got {self.latent_heads}")
        for name in ("decode_lowering", "prefill_lowering"):
            if getattr(self, name) not in ("triton", "mosaic"):
                raise ValueError(f"AttentionTuning.{name} must be 'triton' or 'mosaic', got {getattr(self, name)!r}")


# ----------------------------------------------------------------------------------------------------------
# Pallas kernel


def _attention_kernel(
    meta_ref,
    block_tables_ref,
    q_ref,
    k_pages_ref,
    v_pages_ref,
    *refs,
    group: int,
    block_kv: int,
    page_size: int,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    chunk: int | None,
    num_splits: int,
    use_mma: bool,
    has_last: bool,
    has_sinks: bool,
    kv_copies: int,
    has_alibi: bool = False,
):
    """One program: one block of query tokens of one sequence, one KV head with its whole query-head group (the
    pool's head `kv_head * kv_copies`: the first copy of it).
    With `has_last`, the first of `refs` holds each row's last visible key (`last_key` laid out as the rows); with
    `has_sinks`, the next holds each row's attention-sink logit (applied here, or in `combine_splits`); with
    `has_alibi`, the next each row's ALiBi slope."""
    refs = list(refs)
    last_ref = refs.pop(0) if has_last else None
    sink_ref = refs.pop(0) if has_sinks else None
    slopes = refs.pop(0)[...][:, None] if has_alibi else None  # [rows, 1]
    out_refs = refs
    b, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_pages = k_pages_ref.shape[0]
    pages_per_seq = block_tables_ref.shape[1]
    rows, head_dim = q_ref.shape
    seq = meta_ref[b, 0]
    pos0 = meta_ref[b, 1]  # position of the block's first query token
    num_q = meta_ref[b, 2]  # real query tokens in this block (0: an unused block)

    # Row r holds query token r // group, head r % group of the group; rows past block_q * group are padding.
    row_q = lax.broadcasted_iota(jnp.int32, (rows,), 0) // group
    row_pos = pos0 + row_q  # [rows]
    row_valid = row_q < num_q
    row_last = None if last_ref is None else last_ref[...]  # [rows]

    kv_hi = jnp.where(num_q > 0, pos0 + num_q, 0)  # the last real query sees KV positions < kv_hi
    if row_last is not None:  # a span attended both ways reaches past it
        kv_hi = jnp.maximum(kv_hi, jnp.max(jnp.where(row_valid, row_last, -1)) + 1)
    blk_lo = jnp.minimum(window_start(pos0, sliding_window, block_kv, chunk), pl.cdiv(kv_hi, block_kv))
    num_blocks = pl.cdiv(kv_hi, block_kv) - blk_lo
    per_split = pl.cdiv(num_blocks, num_splits)
    start = blk_lo + split * per_split
    stop = jnp.minimum(blk_lo + num_blocks, start + per_split)

    pieces = head_pieces(head_dim)  # (a head that is no power of two: in power-of-two parts, e.g. 192 = 128 + 64)
    qs = [q_ref[:, pl.ds(o, w)] for o, w in pieces]  # [rows, w] each
    if not use_mma:
        qs = [q.astype(jnp.float32) for q in qs]

    def body(j, carry):
        acc, m_prev, l_prev = carry
        kv_pos = j * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv,), 0)  # [block_kv]
        slot = jnp.minimum(kv_pos // page_size, pages_per_seq - 1)
        page = jnp.clip(block_tables_ref[seq, slot], 0, num_pages - 1)  # page ids read from the table
        offset = kv_pos % page_size
        head = kv_head * kv_copies
        ks = [k_pages_ref[page, offset, head, pl.ds(o, w)] for o, w in pieces]  # [block_kv, w] each
        vs = [v_pages_ref[page, offset, head, pl.ds(o, w)] for o, w in pieces]
        if use_mma and ks[0].dtype != qs[0].dtype:  # narrower pages (float8): tensor-core dots in q's dtype
            ks, vs = [k.astype(qs[0].dtype) for k in ks], [v.astype(qs[0].dtype) for v in vs]
        # Stale pages may hold anything; zero V past the sequence so 0 * garbage cannot poison the sum.
        vs = [jnp.where((kv_pos < kv_hi)[:, None], v, jnp.zeros_like(v)) for v in vs]
        if use_mma:
            s = sum(lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                    for q, k in zip(qs, ks, strict=True))
        else:
            s = sum(jnp.sum(q[:, None, :] * k.astype(jnp.float32)[None, :, :], axis=-1)
                    for q, k in zip(qs, ks, strict=True))
        s = alibi_bias(logits(s, sm_scale, soft_cap), slopes, kv_pos[None, :], row_pos[:, None])
        s = mask_keys(s, kv_pos[None, :], row_pos[:, None], sliding_window,
                      None if row_last is None else row_last[:, None], chunk)
        s = jnp.where(row_valid[:, None], s, -jnp.inf)  # [rows, block_kv]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        alpha = jnp.exp(m_prev - m_next)
        p = jnp.exp(s - m_next[:, None])
        l_next = alpha * l_prev + jnp.sum(p, axis=1)
        if use_mma:
            pv = [jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32) for v in vs]
        else:
            pv = [jnp.sum(p[:, :, None] * v.astype(jnp.float32)[None, :, :], axis=1) for v in vs]
        return tuple(a * alpha[:, None] + x for a, x in zip(acc, pv, strict=True)), m_next, l_next

    init = (tuple(jnp.zeros((rows, w), jnp.float32) for _, w in pieces), jnp.full((rows,), M_FLOOR, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    acc, m, denom = lax.fori_loop(start, stop, body, init)
    store_rows(out_refs, acc, m, denom, num_splits, None if sink_ref is None else sink_ref[...], pieces)


def _resolve_tuning(tuning: AttentionTuning, num_tokens, num_seqs, num_kv_heads, group, kv_capacity, head_dim=128):
    block_q = tuning.block_q
    if block_q is None:
        # About the mean query length: 1 for decode batches, up to 16 tokens for prefill chunks.
        block_q = min(16, next_pow2(pl.cdiv(num_tokens, num_seqs)))
    rows, use_mma, num_blocks = row_tiling(block_q, group, bool(tuning.pad_rows_to_mma), num_tokens, num_seqs)
    # (heads over 256 wide, Gemma 4's 512: 64 keys a step overflow Hopper's shared memory, by 1 KiB; 32 fit)
    block_kv = tuning.block_kv or (64 if use_mma and head_dim <= 256 else 32)
    splits = tuning.num_kv_splits
    if splits is None:
        programs = num_blocks * num_kv_heads
        max_useful = max(1, kv_capacity // (4 * block_kv))  # keep at least ~4 KV blocks per split
        splits = 1
        while splits * 2 <= min(32, max_useful) and programs * splits < _TARGET_PROGRAMS:
            splits *= 2
    num_warps = tuning.num_warps or (8 if rows * block_kv >= 128 * 64 else 4)
    return block_q, rows, use_mma, block_kv, splits, num_warps


def _triton_params(num_warps: int, num_stages: int):
    from jax.experimental.pallas import triton as pl_triton

    return pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window", "attention_chunk",
                                             "interpret", "tuning", "decode", "kv_copies"))
def ragged_paged_attention(
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
    last_key: jax.Array | None = None,
    sinks: jax.Array | None = None,
    interpret: bool = False,
    tuning: AttentionTuning = AttentionTuning(),
    decode: bool = False,
    attention_chunk: int | None = None,
    kv_copies: int = 1,
    alibi: jax.Array | None = None,
) -> jax.Array:
    """Pallas ragged paged attention (prefill chunks and decode in one call); `[T, QH, D]` in q's dtype. `sinks` [QH]:
    each head's attention-sink logit (gpt-oss), a share of each softmax carrying no value (every kernel here takes
    them). `decode` (static): the caller promises at most one query token per sequence (an engine's decode loop), so
    a call that goes to the Mosaic GPU decode kernel holds that kernel alone, not a branch for prefill chunks beside
    it. `attention_chunk`: Llama 4's chunked attention (no key before a token's chunk). `kv_copies` (static): the
    pages hold each KV head that many times over, as heads h * kv_copies to h * kv_copies + kv_copies - 1 (Gemma 4's
    full-attention rows); this kernel reads one copy, the Mosaic ones and the reference all (the same result, more
    bytes). `alibi` [QH]: ALiBi's slope per query head (`alibi_bias`): this kernel's alone, not the Mosaic ones'."""
    check_attention_args(
        q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, sm_scale, soft_cap, sliding_window, last_key,
        sinks, attention_chunk, kv_copies, alibi)
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, pool_heads, _ = k_pages.shape
    num_seqs, pages_per_seq = block_tables.shape
    num_kv_heads = pool_heads // kv_copies
    group = num_q_heads // num_kv_heads
    if head_dim % 16:
        raise ValueError(f"the Pallas kernel needs head_dim a multiple of 16 (read in power-of-two parts of 16 or "
                         f"more), got {head_dim}")
    if num_tokens == 0:
        return jnp.zeros_like(q)
    last_key = clamp_last_key(last_key, seq_lens, query_start_loc, num_tokens)
    if tuning.pad_rows_to_mma is None:
        tuning = dataclasses.replace(tuning, pad_rows_to_mma=not interpret and jnp.dtype(q.dtype).itemsize == 2)
    if "mosaic" in (tuning.decode_lowering, tuning.prefill_lowering) and alibi is None:
        from pallas_kernels.paged_decode_mosaic import mosaic_decode_supported
        from pallas_kernels.ragged_attention_mosaic import ragged_mosaic_supported

        # Each kind of batch goes to its Mosaic GPU kernel where the tuning asks for it and the kernel takes the
        # shapes (the two kernels' SMEM sums differ: 256-wide heads fit only the warp-specialized prefill).
        pool_group = num_q_heads // pool_heads  # (they read every copy)
        decode_on = tuning.decode_lowering == "mosaic" and mosaic_decode_supported(
            q.dtype, head_dim, page_size, pool_group, kv_dtype=k_pages.dtype) is None
        prefill = tuning.prefill_lowering == "mosaic" and ragged_mosaic_supported(
            q.dtype, head_dim, page_size, pool_group, kv_dtype=k_pages.dtype, interpret=interpret) is None
        if decode_on or prefill:
            return _on_mosaic(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, sm_scale=sm_scale,
                              soft_cap=soft_cap, sliding_window=sliding_window, attention_chunk=attention_chunk,
                              last_key=last_key, sinks=sinks, kv_copies=kv_copies,
                              interpret=interpret, tuning=tuning, decode_on_mosaic=decode_on, prefill_on_mosaic=prefill,
                              decode_only=decode)

    block_q, rows, use_mma, block_kv, splits, num_warps = _resolve_tuning(
        tuning, num_tokens, num_seqs, num_kv_heads, group, pages_per_seq * page_size, head_dim)
    num_blocks, meta, gather_tok, tok_block, tok_row, tok_valid = block_layout(seq_lens, query_start_loc, num_tokens,
                                                                              block_q)

    qb = queries_to_blocks(q, gather_tok, num_kv_heads, rows)  # [NB, KVH, rows, D]

    kernel = functools.partial(
        _attention_kernel,
        group=group,
        block_kv=block_kv,
        page_size=page_size,
        sm_scale=float(sm_scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        sliding_window=None if sliding_window is None else int(sliding_window),
        chunk=None if attention_chunk is None else int(attention_chunk),
        num_splits=splits,
        use_mma=use_mma,
        has_last=last_key is not None, has_sinks=sinks is not None, kv_copies=kv_copies,
        has_alibi=alibi is not None)
    # Metadata, block tables and the page pools are whole-array refs: pages are gathered inside the kernel.
    in_specs = [
        pl.BlockSpec(meta.shape, lambda b, h, k: (0, 0)),
        pl.BlockSpec(block_tables.shape, lambda b, h, k: (0, 0)),
        pl.BlockSpec((None, None, rows, head_dim), lambda b, h, k: (b, h, 0, 0)),
        pl.BlockSpec(k_pages.shape, lambda b, h, k: (0, 0, 0, 0)),
        pl.BlockSpec(v_pages.shape, lambda b, h, k: (0, 0, 0, 0)),
    ]
    operands = [meta, block_tables, qb, k_pages, v_pages]
    if last_key is not None:  # each row's last visible key, rows laid out as in `qb` (padding rows: -1)
        rows_last = jnp.repeat(last_key[gather_tok], group, axis=1)
        operands.append(jnp.pad(rows_last, ((0, 0), (0, rows - block_q * group)), constant_values=-1))
        in_specs.append(pl.BlockSpec((None, rows), lambda b, h, k: (b, 0)))
    # Sinks, slopes: [KVH, rows], row r of KV head h is query head h * group + r % group (padding: 0).
    per_head = [None if a is None else jnp.pad(jnp.tile(a.astype(jnp.float32).reshape(num_kv_heads, group),
                                                        (1, block_q)), ((0, 0), (0, rows - block_q * group)))
                for a in (sinks, alibi)]
    sink_rows = per_head[0]
    operands += [a for a in per_head if a is not None]
    in_specs += [pl.BlockSpec((None, rows), lambda b, h, k: (h, 0)) for a in per_head if a is not None]
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct((num_blocks, num_kv_heads, rows, head_dim), q.dtype)
        out_specs = pl.BlockSpec((None, None, rows, head_dim), lambda b, h, k: (b, h, 0, 0))
    else:
        out_shape = (
            jax.ShapeDtypeStruct((splits, num_blocks, num_kv_heads, rows, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((splits, num_blocks, num_kv_heads, rows), jnp.float32),
            jax.ShapeDtypeStruct((splits, num_blocks, num_kv_heads, rows), jnp.float32),
        )
        out_specs = (
            pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, k: (k, b, h, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, k: (k, b, h, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, k: (k, b, h, 0)),
        )
    result = pl.pallas_call(
        kernel,
        grid=(num_blocks, num_kv_heads, splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=None if interpret else _triton_params(num_warps, tuning.num_stages or 2),
        name=f"ragged_paged_attention_bq{block_q}_bkv{block_kv}_s{splits}",
    )(*operands)

    if splits == 1:
        ob = result
    else:
        # [NS, NB, KVH, rows, D], [NS, NB, KVH, rows] x2 -> [NB, KVH, rows, D]
        ob = combine_splits(*result, sinks=None if sink_rows is None else sink_rows[None])

    return blocks_to_tokens(ob, tok_block, tok_row, tok_valid, block_q, group).astype(q.dtype)


def _on_mosaic(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, *, sm_scale, soft_cap, sliding_window,
               attention_chunk, last_key, sinks, kv_copies, interpret, tuning, decode_on_mosaic: bool,
               prefill_on_mosaic: bool, decode_only: bool = False):
    """Decode batches (at most one query token per sequence) on the Mosaic GPU decode kernel, batches with
    prefill chunks on the ragged Mosaic GPU kernel (their decode tokens on the decode kernel with
    `tuning.split_mixed`), each where `*_on_mosaic` says, else this file's kernel. `last_key` (clamped) matters
    to chunks only: a sequence of one query token sees no key past it."""
    from pallas_kernels.paged_decode_mosaic import paged_decode_attention_mosaic
    from pallas_kernels.ragged_attention_mosaic import ragged_paged_attention_mosaic

    num_tokens = q.shape[0]
    args = (q, k_pages, v_pages, block_tables, seq_lens, query_start_loc)
    scores = dict(sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window, attention_chunk=attention_chunk)
    general_tuning = dataclasses.replace(tuning, decode_lowering="triton", prefill_lowering="triton")

    def general():
        return ragged_paged_attention(*args, **scores, last_key=last_key, sinks=sinks, interpret=interpret,
                                      tuning=general_tuning, kv_copies=kv_copies)

    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    tok_seq, _, valid = token_metadata(seq_lens, query_start_loc, num_tokens)

    def on_decode_kernel(lens):
        """The decode kernel's output per token, for the sequences with a token in `lens` (others: 0)."""
        first = jnp.clip(query_start_loc[:-1], 0, num_tokens - 1)  # each sequence's only query token
        o = paged_decode_attention_mosaic(q[first], k_pages, v_pages, block_tables, lens, **scores, sinks=sinks,
                                          num_splits=tuning.num_kv_splits, interpret=interpret)  # [S, QH, D]
        return o[tok_seq]

    def prefill():
        if not prefill_on_mosaic:
            return general()
        if not (decode_on_mosaic and tuning.split_mixed):
            return ragged_paged_attention_mosaic(*args, **scores, interpret=interpret, last_key=last_key, sinks=sinks)
        # The chunks on the ragged kernel, the decode tokens beside them on the decode kernel.
        one = q_lens == 1
        chunks = ragged_paged_attention_mosaic(*args, **scores, interpret=interpret, skip_seqs=one, last_key=last_key,
                                               sinks=sinks)
        tokens = on_decode_kernel(jnp.where(one, seq_lens, 0))
        return jnp.where((one[tok_seq] & valid)[:, None, None], tokens, chunks)

    def decode():
        if not decode_on_mosaic:
            return general()
        return jnp.where(valid[:, None, None], on_decode_kernel(seq_lens), jnp.zeros((), q.dtype))

    if decode_only and decode_on_mosaic:
        return decode()
    return lax.cond(jnp.all(q_lens <= 1), decode, prefill)
