"""The warp-specialized form of the ragged Mosaic GPU kernel (`ragged_attention_mosaic.py`): a program is a
block of `128 // group` query tokens of one KV head, two compute warpgroups of 64 rows each sharing every K/V
block, and a loading warpgroup that fills a two-stage ring by TMA through the block table (float8 pages: into a
landing ring, then upcast into the stage). The compute warpgroups take turns on the tensor cores; the blocks that
need no causal mask skip it. With attention sinks each row's sink logit joins its softmax sum at the end.
"""

from __future__ import annotations

import functools
import math

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
from pallas_kernels.paged_decode_mosaic import ROWS, upcast_rows
from pallas_kernels.ragged_attention_args import (
    M_FLOOR,
    first_key,
    logits,
    mask_keys,
    meta_spans,
    span_last,
    window_start,
)
from pallas_kernels.ragged_mosaic_form import COMPUTE_WGS, STAGES

UPCAST_ROWS = 64  # float8 rows the loading warpgroup upcasts at once (a WGMMA-layout tile)
# Registers per thread of the loading and the compute warpgroups, by 8. `setmaxnreg` only moves registers
# between the warpgroups of a program: the pool is what the program was launched with, 168 a thread for 384
# threads (65536 over 384, rounded down to 8), so the three warpgroups' counts add up to at most 504. Past it
# the compute warpgroups' `setmaxnreg.inc` waits forever for registers that never come free: 80 + 2 x 216 hung
# on an H200. Pages of q's dtype: 40 and 232. Float8 pages, whose upcast needs the loader's 80 (ptxas, sm_90:
# 56 spills 76 bytes, 64 spills 44, 72 spills 16 at 128-wide heads): 80 and 208, no spills at 64- and
# 128-wide heads, with or without sinks, window and soft-cap.
REGISTER_POOL = 504
LOADER_REGISTERS = {False: 40, True: 80}
COMPUTE_REGISTERS = {False: 232, True: 208}
LOG2E = math.log2(math.e)


def _ws_body(meta_ref, block_tables_ref, q_ref, k_pages_ref, v_pages_ref, *refs, block_kv: int, sm_scale: float,
             soft_cap: float | None, window: int | None, chunk: int | None, group: int, has_sinks: bool,
             interpret: bool):
    """One (query block, KV head): warpgroups 0 and 1 compute rows 0-63 and 64-127, warpgroup 2 loads K/V.

    Barriers: `k_bar`/`v_bar[stage]` complete when the stage holds its block; `k_free`/`v_free[stage]` when
    both compute warpgroups are done reading it; `turn` is a rendezvous of the compute warpgroups that hands
    the tensor cores from one to the other. Pages of q's dtype land in the stage by TMA (`k_bar` counts the
    copies). Float8 pages land in a ring of their own (`k_raw`, `k_land` counting the copies), and the loading
    warpgroup upcasts each block into the stage, then arrives on `k_bar`. With `has_sinks` the first of `refs`
    holds each row's attention-sink logit (`[KVH, rows]`; row r: query head r % group).
    """
    sink_ref = refs[0] if has_sinks else None
    o_ref, qo_smem, k_smem, v_smem, *rest = refs[has_sinks:]
    if len(rest) == 6:
        (q_bar, k_bar, v_bar, k_free, v_free, turn_bar), raw = rest, None
    else:
        k_raw, v_raw, q_bar, k_land, v_land, k_bar, v_bar, k_free, v_free, turn_bar = rest
        # Per operand: pages, landing ring and its copies' barriers, stages, stage barriers, releases.
        raw = ((k_pages_ref, k_raw, k_land, k_smem, k_bar, k_free), (v_pages_ref, v_raw, v_land, v_smem, v_bar, v_free))
    plgpu = plgpu_module()
    turn = turn_bar.at[0]  # one barrier, declared as an array of one: the default shape differs across JAX versions
    blk, kv_head, wg = lax.axis_index("block"), lax.axis_index("kv_head"), lax.axis_index("wg")
    layout_cast, iota = register_layouts(interpret)
    pages_per_seq = block_tables_ref.shape[1]
    page_size = k_pages_ref.shape[1]
    head_dim = qo_smem.shape[-1]
    seq, pos0, num_q = meta_ref[blk, 0], meta_ref[blk, 1], meta_ref[blk, 2]
    spans = meta_spans(meta_ref, blk)  # spans attended both ways reach past the block's last token
    kv_len = jnp.where(num_q > 0, pos0 + num_q, 0)  # the keys the block's last token sees
    kv_len = functools.reduce(lambda n, span: jnp.maximum(n, span[1] + 1), spans, kv_len)
    stop = pl.cdiv(kv_len, block_kv)
    lo = jnp.minimum(window_start(pos0, window, block_kv, chunk), stop)  # blocks [lo, stop): loaded, walked by both
    last_page = jnp.clip(pl.cdiv(kv_len, page_size) - 1, 0, pages_per_seq - 1)

    def rendezvous():
        plgpu.barrier_arrive(turn)
        plgpu.barrier_wait(turn)

    @pl.when(wg == COMPUTE_WGS)
    def _load():
        plgpu.set_max_registers(LOADER_REGISTERS[raw is not None], action="decrease")

        def load(j):
            """Block j's K then V into its stage, each once both compute warpgroups released the stage's last use."""
            slot = lax.rem(j, STAGES)
            for pages_ref, smem, bar, free in ((k_pages_ref, k_smem, k_bar, k_free), (v_pages_ref, v_smem, v_bar, v_free)):
                pl.when(j >= lo + STAGES)(functools.partial(plgpu.barrier_wait, free.at[slot]))
                copy_kv_block(pages_ref, smem.at[slot], bar.at[slot], block_tables_ref, seq, j, last_page, kv_head)

        def land(j):
            """Start the copies of block j's float8 K and V pages into their ring (its stage was upcast)."""
            for pages_ref, ring, landed, *_ in raw:
                copy_kv_block(pages_ref, ring.at[lax.rem(j, STAGES)], landed.at[lax.rem(j, STAGES)],
                              block_tables_ref, seq, j, last_page, kv_head)

        def load_upcast(j):
            """Block j+1's copies started, block j's K then V upcast into its stage once both compute
            warpgroups released the stage's last use."""
            slot = lax.rem(j, STAGES)
            pl.when(j + 1 < stop)(functools.partial(land, j + 1))
            for _, ring, landed, smem, bar, free in raw:
                plgpu.barrier_wait(landed.at[slot])
                pl.when(j >= lo + STAGES)(functools.partial(plgpu.barrier_wait, free.at[slot]))
                upcast_rows(ring.at[slot], smem.at[slot], UPCAST_ROWS)
                plgpu.barrier_arrive(bar.at[slot])

        if raw is None:
            pl.loop(lo, stop)(load)
        else:
            pl.when(lo < stop)(functools.partial(land, lo))
            pl.loop(lo, stop)(load_upcast)

        # Observe the last releases too: every phase of a barrier is waited for (the interpreter checks it).
        @pl.loop(jnp.maximum(stop, lo + STAGES) - STAGES, stop)
        def _(j):
            plgpu.barrier_wait(k_free.at[lax.rem(j, STAGES)])
            plgpu.barrier_wait(v_free.at[lax.rem(j, STAGES)])

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(COMPUTE_REGISTERS[raw is not None], action="increase")
        qo = qo_smem.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[blk, kv_head, wg], qo, q_bar.at[wg])
        # This warpgroup's tokens: first and last (rows past the block's tokens repeat the last one's limit).
        first = lax.div(wg * ROWS, group)
        own = first < num_q
        last = jnp.minimum(lax.div(wg * ROWS + ROWS - 1, group), num_q - 1)
        own_len = jnp.where(own, pos0 + last + 1, 0)
        for start, end in spans:  # a span holding some of this warpgroup's tokens
            meets = own & (start <= pos0 + last) & (end >= pos0 + first)
            own_len = jnp.where(meets, jnp.maximum(own_len, end + 1), own_len)
        # This warpgroup's blocks [own_lo, own_stop) (none: both at `stop`), in three runs: blocks where the
        # window (or chunk) of some row starts (masked), blocks every row sees whole (unmasked), blocks reaching
        # past the first token's position (masked).
        own_stop = jnp.where(own, pl.cdiv(own_len, block_kv), stop)
        own_lo = jnp.where(own, window_start(pos0 + first, window, block_kv, chunk), stop)
        bounded = window is not None or chunk is not None  # first keys past 0: nondecreasing along the rows
        whole = jnp.clip(pl.cdiv(jnp.maximum(first_key(pos0 + last, window, chunk), 0), block_kv) if bounded else own_lo,
                         own_lo, own_stop)
        unmasked = jnp.clip((pos0 + first + 1) // block_kv, whole, own_stop)

        def masked_keys(s, j):
            """Row r (token (64 wg + r) // group) sees the keys up to its token's position, or its span's end
            (and within its window or chunk). The index tiles are made here, in the few masked blocks, rather than held in registers
            across the whole loop."""
            row = iota(jnp.int32, (ROWS, block_kv), 0, layout=plgpu.Layout.WGMMA)
            col = iota(jnp.int32, (ROWS, block_kv), 1, layout=plgpu.Layout.WGMMA)
            row_pos = jnp.minimum(pos0 + lax.div(wg * ROWS + row, group), pos0 + last)
            return mask_keys(s, j * block_kv + col, row_pos, window, span_last(row_pos, spans) if spans else None,
                             chunk)

        rows_layout = plgpu.Layout.WGMMA.reduce(1)
        m0 = layout_cast(jnp.full((ROWS,), M_FLOOR, jnp.float32), rows_layout)
        l0 = layout_cast(jnp.full((ROWS,), 0.0, jnp.float32), rows_layout)
        acc0 = layout_cast(jnp.full((ROWS, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)

        def step(j, carry, masked: bool):
            acc, m_prev, l_prev = carry
            slot = lax.rem(j, STAGES)
            plgpu.barrier_wait(k_bar.at[slot])
            # The interpreter's WGMMA takes neither a transposed SMEM operand nor a register one: under it, the
            # same products are plain dots.
            if interpret:
                s = lax.dot_general(qo[...], k_smem.at[slot][...], (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32)
                rendezvous()
            else:
                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, qo, k_smem.at[slot].transpose((1, 0)))
                    rendezvous()  # the other warpgroup's products start while this one's QK^T finishes
                    return acc_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((ROWS, block_kv), jnp.float32))
            plgpu.barrier_arrive(k_free.at[slot])
            s = logits(s, sm_scale, soft_cap, LOG2E)  # base-2 logits: exp2 below
            if masked:
                s = masked_keys(s, j)
            m_next = jnp.maximum(m_prev, s.max(axis=1))  # at least M_FLOOR: exp2(-inf - m) below is 0, never NaN
            alpha = jnp.exp2(m_prev - m_next)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_next, s.shape, [0]))
            l_next = l_prev * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            p = p.astype(qo.dtype)
            plgpu.barrier_arrive(turn)
            plgpu.barrier_wait(v_bar.at[slot])
            plgpu.barrier_wait(turn)  # the tensor cores are this warpgroup's again
            if interpret:
                acc = acc + jnp.dot(p, v_smem.at[slot][...], preferred_element_type=jnp.float32)
            else:
                acc = pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, p, v_smem.at[slot]))(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_next, l_next

        def drain(j, _):
            """A block before this warpgroup's first window or past its last token: release the stage, keep the
            turns in step."""
            slot = lax.rem(j, STAGES)
            plgpu.barrier_wait(k_bar.at[slot])  # so each arrival lands in the stage's current phase
            plgpu.barrier_arrive(k_free.at[slot])
            rendezvous()
            plgpu.barrier_arrive(turn)
            plgpu.barrier_wait(v_bar.at[slot])
            plgpu.barrier_wait(turn)
            plgpu.barrier_arrive(v_free.at[slot])

        pl.when(wg == 1)(rendezvous)  # warpgroup 1 starts half a step behind warpgroup 0
        plgpu.barrier_wait(q_bar.at[wg])
        lax.fori_loop(lo, own_lo, drain, None)
        carry = (acc0, m0, l0)
        if bounded:
            carry = lax.fori_loop(own_lo, whole, functools.partial(step, masked=True), carry)
        carry = lax.fori_loop(whole, unmasked, functools.partial(step, masked=False), carry)
        acc, m, denom = lax.fori_loop(unmasked, own_stop, functools.partial(step, masked=True), carry)
        lax.fori_loop(own_stop, stop, drain, None)
        pl.when(wg == 0)(rendezvous)

        if sink_ref is None:
            denom = lax.broadcast_in_dim(jnp.where(denom == 0.0, 1.0, denom), acc.shape, [0])
        else:  # each row's sink joins its sum, in the base-2 units of m (a row with no key: exp2 of a huge number, 0 out)
            head = lax.rem(wg * ROWS + iota(jnp.int32, acc.shape, 0, layout=plgpu.Layout.WGMMA), group)
            sink = functools.reduce(lambda x, g: jnp.where(head == g, sink_ref[kv_head, g], x), range(1, group),
                                    jnp.where(head == 0, sink_ref[kv_head, 0], 0.0))
            denom = (lax.broadcast_in_dim(denom, acc.shape, [0])
                     + jnp.exp2(sink * LOG2E - lax.broadcast_in_dim(m, acc.shape, [0])))
        qo[...] = (acc / denom).astype(qo.dtype)  # q is read no more
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(qo, o_ref.at[blk, kv_head, wg])
        plgpu.wait_smem_to_gmem(0)


def ws_attention_blocks(qb, meta, k_pages, v_pages, block_tables, *, sm_scale, soft_cap, window, block_kv, group,
                        interpret, name, sinks=None, chunk=None):
    """The warp-specialized kernel over query blocks: qb `[NB, KVH, 2, ROWS, D]` -> the same shape, q's dtype.
    `sinks` `[KVH, 2 * ROWS]` float32: each row's attention-sink logit."""
    plgpu = plgpu_module()
    num_blocks, num_kv_heads, _, _, head_dim = qb.shape
    tile = () if interpret else swizzled(qb.dtype, head_dim)
    pages_per_block = block_kv // k_pages.shape[1]
    # One arrival per page copy: a block has landed when all of its pages have.
    landed = plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=STAGES)
    scratch = [
        plgpu.SMEM((COMPUTE_WGS, ROWS, head_dim), qb.dtype, transforms=tile),
        plgpu.SMEM((STAGES, block_kv, head_dim), qb.dtype, transforms=tile),
        plgpu.SMEM((STAGES, block_kv, head_dim), qb.dtype, transforms=tile),
    ]
    if k_pages.dtype == qb.dtype:
        scratch += [plgpu.Barrier(num_arrivals=1, num_barriers=COMPUTE_WGS), landed, landed]
    else:  # float8: the landing ring, the copies' barriers, and the stages' (one arrival: the upcast's)
        kv_tile = () if interpret else swizzled(k_pages.dtype, head_dim)
        scratch += [plgpu.SMEM((STAGES, block_kv, head_dim), k_pages.dtype, transforms=kv_tile)] * 2
        scratch += [plgpu.Barrier(num_arrivals=1, num_barriers=COMPUTE_WGS), landed, landed]
        scratch += [plgpu.Barrier(num_arrivals=1, num_barriers=STAGES)] * 2
    scratch += [
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=STAGES),
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=STAGES),
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=1),
    ]
    body = functools.partial(_ws_body, block_kv=block_kv, sm_scale=float(sm_scale), group=group,
                             soft_cap=None if soft_cap is None else float(soft_cap),
                             window=None if window is None else int(window), has_sinks=sinks is not None,
                             chunk=None if chunk is None else int(chunk),
                             interpret=interpret)
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(qb.shape, qb.dtype),
        scratch_types=scratch,
        grid=(num_blocks, num_kv_heads),
        grid_names=("block", "kv_head"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        interpret=interpret_params() if interpret else None,
        compiler_params=None if interpret else compiler_params(),
        kernel_name=name,
    )(meta, block_tables, qb, k_pages, v_pages, *([] if sinks is None else [sinks]))
