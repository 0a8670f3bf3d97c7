"""Paged attention written for Mosaic GPU (`plgpu`), Hopper only: the kernel, and its decode wrapper (one
query token per sequence; `ragged_attention_mosaic.py` wraps it for prefill chunks).

One program (one warpgroup) serves one query block (decode: one sequence's token) and one KV head, optionally
one of several partitions of the KV length (flash decoding, decode only). The block's query rows (its tokens
times the head group) are padded to the 64 rows of a WGMMA tile, each row causal to its token; KV arrives
`block_kv` tokens at a time by TMA, one copy per page (a `[page_size, head_dim]` strided box of the pool), into a
ring of `stages` SMEM buffers (2 by default), so the next blocks' pages are in flight while this one is multiplied.
QK^T and PV run on the tensor cores in float32 accumulators; the softmax is online, in float32. Split partials
are float32, or q's dtype where that tile does not fit (256-wide heads), combined in float32. An optional
logit soft-cap (`cap * tanh(x / cap)`) and sliding window apply as in the generic kernel; with a window, the walk
over the KV length starts at the block where the window does, so a long context reads only the window's pages.

Float8 pages (e4m3 or e5m2) with bfloat16 or float16 queries move half the bytes: each block lands in SMEM as
float8 and is upcast through registers, 64 x 128 elements at a time, into a q-dtype tile the tensor cores read
(Hopper's float8 WGMMA takes no MN-major B operand, which V is, and no mixed operand types). The per-layer KV
scales stay outside the kernel, as for the generic kernel: q carries k_scale and the output v_scale.

The PV product accumulates onto the float32 accumulator in place: at 256-wide heads that tile is 128 registers
a thread, and a fresh accumulator plus an add (the interpreter's form) would spill.

Rows past a sequence's length are masked to zero probability. Table entries past the sequence's last page are
never read (the block re-reads the last real page instead); the rows of that last page past the length still
enter the PV product as `0 * v`, so they must be finite, as in the engine's pools (zeroed, then written K/V).

Checked in Mosaic GPU's CPU interpreter (`interpret=True`: the two products as plain dots), compiled for sm_90
without a GPU (tests/gpu_compile), and compiled on a GPU (bench/gpu_check.sh).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.mosaic_common import (
    compiler_params,
    copy_kv_block,
    interpret_params,
    plgpu_module,
    register_layouts,
    swizzled,
)
from pallas_kernels.ragged_attention_args import (
    FP8_KV_DTYPES,
    M_FLOOR,
    check_score_args,
    combine_splits,
    default_splits,
    key_capacity,
    logits,
    mask_keys,
    meta_spans,
    span_last,
    window_start,
)

GRID_NAMES = ("block", "kv_head", "split")
ROWS = 64  # the M of a Hopper WGMMA tile: the head group's query rows are padded to it
SMEM_BYTES = 232448  # opt-in shared memory per block on H100/H200
SMEM_OVERHEAD = 4096  # barriers and the alignment of each scratch buffer


def _attention_body(
    meta_ref,
    block_tables_ref,
    q_ref,
    k_pages_ref,
    v_pages_ref,
    *refs,
    page_size: int,
    block_kv: int,
    sm_scale: float,
    soft_cap: float | None,
    window: int | None,
    chunk: int | None,
    num_splits: int,
    partials: bool,
    group: int,
    interpret: bool,
):
    """One (query block, KV head, split): online softmax over the split's KV blocks, tensor-core dots.

    A query block is up to `ROWS // group` consecutive query tokens of one sequence, each with the `group`
    query heads of the KV head (row r: token r // group); `meta_ref[block]` = (sequence, position of the
    block's first token, number of tokens, unused). Row r sees the keys at positions up to its token's
    (causal) and, with a sliding window, after its token's position minus `window` (with chunks, none before
    its chunk of `chunk` positions); a decode token is a block of one. The walk starts at the KV block where the
    first token's window (or chunk) starts. With `partials` (splits, or
    attention sinks) it writes the unnormalized accumulator and each row's max and sum, for `combine_splits`.
    """
    plgpu = plgpu_module()
    blk, kv_head, split = (lax.axis_index(name) for name in GRID_NAMES)
    layout_cast, iota = register_layouts(interpret)

    # Outputs, then scratch: q and output tiles, [split row max/sum], K/V blocks, [upcast K/V tiles], barriers.
    n_out = 3 if partials else 1
    outs, (q_smem, o_smem), rest = refs[:n_out], refs[n_out:n_out + 2], refs[n_out + 2:]
    q_bar, k_bar, v_bar = rest[-3:]
    if not partials:
        (o_ref,), (k_smem, v_smem, *upcast) = outs, rest[:-3]
    else:
        (o_ref, m_ref, l_ref), (m_smem, l_smem, k_smem, v_smem, *upcast) = outs, rest[:-3]
    pages_per_seq = block_tables_ref.shape[1]
    head_dim = q_smem.shape[-1]

    plgpu.copy_gmem_to_smem(q_ref.at[blk, kv_head], q_smem, q_bar.at[0])
    seq, pos0, num_q = meta_ref[blk, 0], meta_ref[blk, 1], meta_ref[blk, 2]
    tok_end = jnp.where(num_q > 0, pos0 + num_q, 0)  # the keys the block's last token sees
    spans = meta_spans(meta_ref, blk)
    kv_len = functools.reduce(lambda n, span: jnp.maximum(n, span[1] + 1), spans, tok_end)  # spans reach further
    num_blocks = pl.cdiv(kv_len, block_kv)
    lo = jnp.minimum(window_start(pos0, window, block_kv, chunk), num_blocks)
    per_split = pl.cdiv(num_blocks - lo, num_splits)
    start = lo + split * per_split
    stop = jnp.minimum(num_blocks, start + per_split)

    # Entries past the last page may name the scratch page (anything): a block past the end re-reads the last.
    last_page = jnp.clip(pl.cdiv(kv_len, page_size) - 1, 0, pages_per_seq - 1)

    def issue(j, slot):
        """Start the TMA copies of block j's pages into buffer `slot`."""
        for pages_ref, smem, bar in ((k_pages_ref, k_smem, k_bar), (v_pages_ref, v_smem, v_bar)):
            copy_kv_block(pages_ref, smem.at[slot], bar.at[slot], block_tables_ref, seq, j, last_page, kv_head)

    stages = k_smem.shape[0]
    for i in range(stages - 1):  # the first blocks in flight before any is multiplied
        pl.when(start + i < stop)(functools.partial(issue, start + i, i))

    plgpu.barrier_wait(q_bar.at[0])

    wgmma_rows = plgpu.Layout.WGMMA.reduce(1)
    m0 = layout_cast(jnp.full((ROWS,), M_FLOOR, jnp.float32), wgmma_rows)
    l0 = layout_cast(jnp.full((ROWS,), 0.0, jnp.float32), wgmma_rows)
    acc0 = layout_cast(jnp.full((ROWS, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)

    # Each row's position (padding rows: the block's last token's) and, in a span attended both ways, its last
    # visible key.
    row = iota(jnp.int32, (ROWS, block_kv), 0, layout=plgpu.Layout.WGMMA)
    col = iota(jnp.int32, (ROWS, block_kv), 1, layout=plgpu.Layout.WGMMA)
    row_pos = jnp.minimum(pos0 + lax.div(row, group), tok_end - 1)
    row_last = span_last(row_pos, spans) if spans else None

    def body(j, carry):
        acc, m_prev, l_prev = carry
        slot = lax.rem(j - start, stages)
        ahead = j + stages - 1
        # Into block j - 1's stage, which its dots (already awaited) have consumed.
        pl.when(ahead < stop)(functools.partial(issue, ahead, lax.rem(ahead - start, stages)))

        plgpu.barrier_wait(k_bar.at[slot])
        k_op = upcast_rows(k_smem.at[slot], upcast[0]) if upcast else k_smem.at[slot]

        # The interpreter's WGMMA takes neither a transposed SMEM operand nor a register one: under it, the
        # same products are plain dots.
        if interpret:
            s = lax.dot_general(q_smem[...], k_op[...], (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)
        else:
            def qk_scope(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_op.transpose((1, 0)))
                return acc_ref[...]

            s = pl.run_scoped(qk_scope, plgpu.ACC((ROWS, block_kv), jnp.float32))
        s = mask_keys(logits(s, sm_scale, soft_cap), j * block_kv + col, row_pos, window, row_last,
                      chunk)  # [ROWS, bkv]
        m_next = jnp.maximum(m_prev, s.max(axis=1))  # at least M_FLOOR: exp(-inf - m) below is 0, never NaN
        alpha = jnp.exp(m_prev - m_next)
        p = jnp.exp(s - lax.broadcast_in_dim(m_next, s.shape, [0]))
        l_next = l_prev * alpha + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

        plgpu.barrier_wait(v_bar.at[slot])
        v_op = upcast_rows(v_smem.at[slot], upcast[1]) if upcast else v_smem.at[slot]

        p = p.astype(q_smem.dtype)
        if interpret:  # nor a register operand
            acc = acc + jnp.dot(p, v_op[...], preferred_element_type=jnp.float32)
        else:  # onto `acc` in place: a fresh accumulator and an add would hold two [ROWS, head_dim] tiles
            acc = pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, p, v_op))(plgpu.ACC.init(acc))
        return acc, m_next, l_next

    acc, m, denom = lax.fori_loop(start, stop, body, (acc0, m0, l0))
    if not partials:
        safe = jnp.where(denom == 0.0, 1.0, denom)
        o_smem[...] = (acc / lax.broadcast_in_dim(safe, acc.shape, [0])).astype(o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[blk, kv_head])
    else:
        # Partial results for the combine: the unnormalized accumulator (float32, or q's dtype where a float32
        # tile does not fit: 256-wide heads), its row max and row sum (an empty split's m stays at M_FLOOR, so
        # the combine's exp(m - max) is 0, not NaN).
        o_smem[...] = acc.astype(o_smem.dtype)
        m_smem[...] = m
        l_smem[...] = denom
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[split, blk, kv_head])
        plgpu.copy_smem_to_gmem(m_smem, m_ref.at[split, blk, kv_head])
        plgpu.copy_smem_to_gmem(l_smem, l_ref.at[split, blk, kv_head])
    plgpu.wait_smem_to_gmem(0)


def upcast_rows(src, dst, rows: int = ROWS, cols: int = 128):
    """`dst` (a q-dtype SMEM tile) holding the float8 block `src`, `rows` x `cols` at a time through registers
    (a 64 x 128 chunk is 64 float32 registers a thread)."""
    cols = min(cols, src.shape[1])
    for r in range(0, src.shape[0], rows):
        for c in range(0, src.shape[1], cols):
            chunk = (pl.ds(r, rows), pl.ds(c, cols))
            # float8 converts to 16-bit floats in hardware; float32 is the path both bfloat16 and float16 accept.
            dst[chunk] = src[chunk].astype(jnp.float32).astype(dst.dtype)
    plgpu_module().commit_smem()  # the stores, visible to the tensor cores' (async proxy) reads
    return dst


def mosaic_decode_supported(
    dtype, head_dim: int, page_size: int, group: int, block_kv: int = 64, kv_dtype=None, smem: int | None = None,
    stages: int = 2,
) -> str | None:
    """None when the kernel takes these shapes, else the reason it does not. `kv_dtype`: the pages' (q's);
    `smem`: the shared memory of the kernel's program (this file's kernel's when None)."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"the Mosaic GPU kernels take bfloat16 or float16, got {jnp.dtype(dtype).name}"
    kv_dtype = jnp.dtype(dtype if kv_dtype is None else kv_dtype)
    if kv_dtype != jnp.dtype(dtype) and kv_dtype not in FP8_KV_DTYPES:
        return f"the Mosaic GPU kernels take pages of q's dtype or float8, got {kv_dtype.name}"
    if group > ROWS:
        return f"a head group of {group} query heads exceeds the {ROWS} rows of a WGMMA tile"
    if head_dim % 64:
        return f"the Mosaic GPU kernels need head_dim a multiple of 64, got {head_dim}"
    if page_size % 8:
        return f"the Mosaic GPU kernels need page_size a multiple of 8, got {page_size}"
    if block_kv % page_size or block_kv % 64 or block_kv > 256:
        return f"block_kv ({block_kv}) must be a multiple of 64 and of page_size ({page_size}), at most 256"
    if stages < 2:
        return f"the K/V ring needs at least 2 stages, got {stages}"
    if smem is None:  # with split partials in q's dtype, the smallest form
        itemsize = jnp.dtype(dtype).itemsize
        smem = smem_bytes(itemsize, head_dim, block_kv, kv_dtype.itemsize, stages, partial_itemsize=itemsize)
    if smem > SMEM_BYTES:
        return (f"block_kv {block_kv} x head_dim {head_dim} in {stages} stages needs {smem} bytes of shared memory, "
                f"over {SMEM_BYTES}")
    return None


def smem_bytes(itemsize: int, head_dim: int, block_kv: int, kv_itemsize: int | None = None, stages: int = 2,
               partial_itemsize: int | None = 4) -> int:
    """Shared memory of one program: the ring of K and V blocks (and their upcast tiles when the pages are
    narrower than q), the q tile, and the output tile: with splits, the partial accumulator
    (`partial_itemsize` bytes an element) and its row maxima and sums; without (None), the output in q's
    dtype."""
    kv_itemsize = kv_itemsize or itemsize
    upcast = 2 * block_kv * head_dim * itemsize if kv_itemsize != itemsize else 0
    kv = stages * 2 * block_kv * head_dim * kv_itemsize + upcast
    out = ROWS * head_dim * itemsize if partial_itemsize is None else ROWS * head_dim * partial_itemsize + 2 * ROWS * 4
    return kv + ROWS * head_dim * itemsize + out + SMEM_OVERHEAD


def partial_dtype(dtype, head_dim: int, block_kv: int, kv_dtype, stages: int):
    """The dtype of the split partials' accumulators: float32 where its tile fits beside the ring, else q's."""
    smem = smem_bytes(jnp.dtype(dtype).itemsize, head_dim, block_kv, jnp.dtype(kv_dtype).itemsize, stages)
    return jnp.dtype(jnp.float32 if smem <= SMEM_BYTES else dtype)


def check_mosaic_args(q, k_pages, v_pages, block_tables, block_kv: int, smem: int | None = None,
                      stages: int = 2) -> int:
    """The head group of these operands when the kernel takes them; raises naming the problem otherwise."""
    if q.ndim != 3 or k_pages.ndim != 4 or k_pages.shape[3] != q.shape[2] or v_pages.shape != k_pages.shape:
        raise ValueError(f"expected q [T, QH, D] and pages [N, page_size, KVH, D], got {q.shape}, {k_pages.shape}")
    _, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if v_pages.dtype != k_pages.dtype:
        raise TypeError(f"v_pages dtype {v_pages.dtype} differs from k_pages dtype {k_pages.dtype}")
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables must be [S, pages_per_seq], got {block_tables.shape}")
    group = num_q_heads // num_kv_heads
    reason = mosaic_decode_supported(q.dtype, head_dim, page_size, group, block_kv, kv_dtype=k_pages.dtype,
                                     smem=smem, stages=stages)
    if reason is not None:
        raise ValueError(reason)
    return group


def mosaic_attention_blocks(qb, meta, k_pages, v_pages, block_tables, *, sm_scale: float, block_kv: int,
                            splits: int, group: int, interpret: bool, name: str, stages: int = 2,
                            soft_cap: float | None = None, window: int | None = None, chunk: int | None = None,
                            sinks: jax.Array | None = None) -> jax.Array:
    """The kernel over query blocks: qb `[NB, KVH, ROWS, D]` (row r: token r // group of the block, head
    r % group of the KV head's group), meta `[NB, 4]` int32 (sequence, first position, tokens, 0; or `[NB, 8]`
    with the spans attended both ways of `block_spans`) ->
    `[NB, KVH, ROWS, D]` float32. With splits (flash decoding) each split walks a share of a block's KV blocks; a
    row that sees none of a split's keys gets nothing from it. `sinks` `[KVH, ROWS]`: each row's attention-sink
    logit, applied where the partials (then written even for one split) are combined."""
    plgpu = plgpu_module()
    num_blocks, num_kv_heads, _, head_dim = qb.shape
    page_size = k_pages.shape[1]
    tile = () if interpret else swizzled(qb.dtype, head_dim)
    kv_tile = () if interpret else swizzled(k_pages.dtype, head_dim)
    # Every operand stays in GMEM and moves by explicit TMA copies: pages are gathered through the block table.
    scratch = [plgpu.SMEM((ROWS, head_dim), qb.dtype, transforms=tile)]
    partials = splits > 1 or sinks is not None
    if not partials:
        out_shape = jax.ShapeDtypeStruct((num_blocks, num_kv_heads, ROWS, head_dim), qb.dtype)
        scratch.append(plgpu.SMEM((ROWS, head_dim), qb.dtype, transforms=tile))
    else:
        acc_dtype = partial_dtype(qb.dtype, head_dim, block_kv, k_pages.dtype, stages)
        rows = jax.ShapeDtypeStruct((splits, num_blocks, num_kv_heads, ROWS), jnp.float32)
        out_shape = (jax.ShapeDtypeStruct((splits, num_blocks, num_kv_heads, ROWS, head_dim), acc_dtype),
                     rows, rows)
        scratch += [
            plgpu.SMEM((ROWS, head_dim), acc_dtype, transforms=() if interpret else swizzled(acc_dtype, head_dim)),
            plgpu.SMEM((ROWS,), jnp.float32),
            plgpu.SMEM((ROWS,), jnp.float32),
        ]
    scratch += [
        plgpu.SMEM((stages, block_kv, head_dim), k_pages.dtype, transforms=kv_tile),
        plgpu.SMEM((stages, block_kv, head_dim), v_pages.dtype, transforms=kv_tile),
    ]
    if k_pages.dtype != qb.dtype:  # the upcast K and V tiles the tensor cores read
        scratch += [plgpu.SMEM((block_kv, head_dim), qb.dtype, transforms=tile)] * 2
    scratch += [
        plgpu.Barrier(num_arrivals=1, num_barriers=1),  # explicit: the default shape differs across JAX versions
        # One arrival per page copy: the block is ready when all of its pages have landed.
        plgpu.Barrier(num_arrivals=block_kv // page_size, num_barriers=stages),
        plgpu.Barrier(num_arrivals=block_kv // page_size, num_barriers=stages),
    ]
    body = functools.partial(
        _attention_body, page_size=page_size, block_kv=block_kv, sm_scale=float(sm_scale), num_splits=splits,
        partials=partials, group=group, interpret=interpret, soft_cap=None if soft_cap is None else float(soft_cap),
        window=None if window is None else int(window), chunk=None if chunk is None else int(chunk),
    )
    # A Mosaic GPU kernel over a (query block, KV head, split) grid of one-warpgroup programs; its scratch is
    # allocated per program. `plgpu.kernel` is the entry point both JAX 0.10 and 0.11 lower for the GPU
    # (0.11 no longer lowers a `pallas_call` with Mosaic GPU compiler params) and run in the CPU interpreter.
    result = plgpu.kernel(
        body,
        out_type=out_shape,
        scratch_types=scratch,
        grid=(num_blocks, num_kv_heads, splits),
        grid_names=GRID_NAMES,
        interpret=interpret_params() if interpret else None,
        compiler_params=None if interpret else compiler_params(),
        kernel_name=name,
    )(meta, block_tables, qb, k_pages, v_pages)
    if not partials:
        return result.astype(jnp.float32)
    # [NS, NB, KVH, ROWS(, D)] -> [NB, KVH, ROWS, D]
    return combine_splits(result[0].astype(jnp.float32), *result[1:], sinks=None if sinks is None else sinks[None])


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window", "attention_chunk", "block_kv",
                                             "num_splits", "stages", "interpret"))
def paged_decode_attention_mosaic(
    q,
    k_pages,
    v_pages,
    block_tables,
    seq_lens,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    block_kv: int = 64,
    num_splits: int | None = None,
    stages: int = 2,
    interpret: bool = False,
    sinks: jax.Array | None = None,
    attention_chunk: int | None = None,
) -> jax.Array:
    """Decode attention, one query token per sequence: q `[S, QH, D]` -> `[S, QH, D]` (Mosaic GPU), with the
    optional logit soft-cap, sliding window, chunks and attention sinks (`[QH]`) of `ragged_paged_attention`.
    `stages`: K/V blocks in the SMEM ring (in flight while one is multiplied: stages - 1)."""
    check_score_args(sm_scale, soft_cap, sliding_window, attention_chunk)
    group = check_mosaic_args(q, k_pages, v_pages, block_tables, block_kv, stages=stages)
    num_seqs, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    if block_tables.shape[0] != num_seqs or seq_lens.shape != (num_seqs,):
        raise ValueError(f"block_tables {block_tables.shape} and seq_lens {seq_lens.shape} must have {num_seqs} rows")
    # A window or a chunk bounds the keys any token reads, hence the useful splits.
    capacity = key_capacity(block_tables.shape[1] * page_size, sliding_window, attention_chunk, 1, block_kv)
    splits = num_splits or default_splits(num_seqs, num_kv_heads, capacity, block_kv)

    qg = q.reshape(num_seqs, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, ROWS - group), (0, 0)))  # [S, KVH, ROWS, D]
    seq_lens = seq_lens.astype(jnp.int32)
    has_token = (seq_lens > 0).astype(jnp.int32)  # an empty sequence is a padding row: no token
    meta = jnp.stack([jnp.arange(num_seqs, dtype=jnp.int32), seq_lens - has_token, has_token,
                      jnp.zeros_like(seq_lens)], axis=1)
    ob = mosaic_attention_blocks(qg, meta, k_pages, v_pages, block_tables, sm_scale=sm_scale, block_kv=block_kv,
                                 splits=splits, group=group, interpret=interpret, stages=stages,
                                 soft_cap=soft_cap, window=sliding_window, chunk=attention_chunk,
                                 sinks=None if sinks is None else jnp.pad(sinks.astype(jnp.float32).reshape(
                                     num_kv_heads, group), ((0, 0), (0, ROWS - group))),
                                 name=f"paged_decode_mosaic_bkv{block_kv}_s{splits}_st{stages}")
    return ob[:, :, :group].reshape(num_seqs, num_q_heads, head_dim).astype(q.dtype)
