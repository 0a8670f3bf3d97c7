"""Paged attention over the KV page pool, dispatched by backend.

All backends share one contract (`pallas_kernels.ragged_attention_args`, see also `ModelInputs`):
queries packed by sequence, KV read through each sequence's page table, causal within the sequence.
The `xla` backend here is plain `jax.numpy` and is what the CPU serves with: it walks blocks of pages
with an online softmax, so its memory stays bounded by a block whatever the context. The kernels'
oracle (`pallas_kernels.ragged_paged_attention_reference`) gathers whole sequences instead; a test
holds the two equal.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from jaxserve.models.head_shards import on_head_shards
from jaxserve.models.kv_pages import read_pages
from pallas_kernels.ragged_attention_args import (
    alibi_bias,
    clamp_last_key,
    first_key,
    sink_denom,
    token_metadata,
)

AttentionBackend = Literal["xla", "pallas", "pallas_interpret", "pallas_mosaic", "pallas_mosaic_interpret"]
# pallas_mosaic: attention on the Mosaic GPU kernels (Hopper): decode-only batches on the decode kernel, batches
# with prefill chunks on the ragged kernel, each where it takes the shapes (else the generic kernel).
ATTENTION_BACKENDS: tuple[str, ...] = ("xla", "pallas", "pallas_interpret", "pallas_mosaic", "pallas_mosaic_interpret")


def xla_ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array | None,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    last_key: jax.Array | None = None,
    pages_per_block: int | None = None,
    query_block: int = 32,
    decode: bool = False,
    kv_dtype=None,
    sinks: jax.Array | None = None,
    chunk: int | None = None,
    alibi: jax.Array | None = None,
) -> jax.Array:
    """Ragged paged attention in plain JAX, with an online softmax over blocks of pages.

    q: [T, Hq, D]; k_pages, v_pages: [N, page_size, Hkv, D], or [N, page_size, D] for one KV head (v_pages None: the
    keys are the values, as an MLA model's latent entries are); block_tables: [S, P]; seq_lens: [S]; query_start_loc:
    [S + 1]. Returns [T, Hq, D] in q's dtype (zero for padding tokens).

    Two forms. With `decode` (static: every sequence has at most one query token), each token reads its own sequence's
    pages: all tokens at once, or `query_block` real tokens at a time when there are more rows than that (padding and
    finished rows cost nothing). Otherwise each prompt chunk's queries go in tiles of `query_block` tokens that share
    one read of the sequence's pages (a chunk reads its context once per tile, not once per token), and decode tokens
    go `query_block` at a time (the rest in pieces of 8, 2 and 1); a chunk's last 1 to `SMALL_BLOCK` queries (a short
    chunk: drafts being verified) go in a tile of that many rows. Both walk the KV in blocks of `pages_per_block`
    pages, only as far as the keys the queries can see; by default (None) a prompt tile reads `TILE_PAGES_PER_BLOCK`
    pages at a time and a token its own `row_pages_per_block`.

    `kv_dtype` (static) is the dtype the pages hold when the pools are their raw bits (unsigned integers of its width;
    see `kv_storage_bits`), else None. `last_key` [T]: spans attended both ways (the kernels' contract,
    `pallas_kernels.ragged_attention_args`); `sinks` [Hq]: each head's attention-sink logit (gpt-oss); `chunk`: a query
    sees the keys of its own chunk of positions only (Llama 4's); `alibi` [Hq]: ALiBi's slopes (`alibi_bias`).
    """
    kw = dict(sm_scale=sm_scale, soft_cap=soft_cap, span=(sliding_window, chunk), alibi=alibi,
              pages_per_block=pages_per_block, query_block=query_block, kv_dtype=kv_dtype, sinks=sinks)
    last_key = clamp_last_key(last_key, seq_lens, query_start_loc, q.shape[0])
    args = (q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, last_key)
    if decode:
        return _per_token_attention(*args, **kw)
    return _tiled_attention(*args, **kw)


def pad_to_blocks(tables: jax.Array, pages_per_block: int) -> tuple[jax.Array, int]:
    """Page tables [S, P] padded with page 0 to whole blocks (its keys lie past every position, so
    they are masked), and the block size: at most P pages."""
    B = min(pages_per_block, tables.shape[1])
    if tables.shape[1] % B:
        tables = jnp.pad(tables, ((0, 0), (0, B - tables.shape[1] % B)))
    return tables, B


# A prompt tile reads its sequence's pages 4 at a time. Measured per layer on the CPU, two 64-token
# chunks after 0/128/384 cached tokens: SmolLM2's heads 2.30/4.39/8.69 ms with 8 pages, 1.36/3.64/8.07
# with 4; heads of 8 x 128: 14.8/25.7/47.9 ms with 8, 7.6/19.1/42.3 with 4.
TILE_PAGES_PER_BLOCK = 4
SMALL_BLOCK = 8  # rows of a prompt chunk's last, small tile, and of the decode pieces after whole `query_block`s
_ROW_BLOCK_BYTES = 32 << 10


def row_pages_per_block(page_size: int, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Pages per block when every query row reads its own pages (decode): the most pages (a power of
    two, at most 16) whose keys for one row fit in 32 KiB, and at least one. Measured per layer on the
    CPU, 32 rows at contexts of 240-900 keys in random pages: SmolLM2's heads (3 x 64, float32, 12 KiB
    per page of 16) take 2 pages, 1.3-1.8x faster than 8; heads of 8 x 128 (64 KiB per page) take 1,
    2.6-3.3x faster than 8."""
    page_bytes = page_size * num_kv_heads * head_dim * itemsize
    b = 1
    while b < 16 and 2 * b * page_bytes <= _ROW_BLOCK_BYTES:
        b *= 2
    return b


def _scores(s: jax.Array, soft_cap: float | None, alibi: jax.Array | None, kpos: jax.Array, pos: jax.Array):
    """Scaled scores s [R, Hkv, G, J] soft-capped, plus ALiBi's bias (`alibi` [Hq]) of keys kpos [J] to rows at pos
    [R]."""
    s = s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)
    return alibi_bias(s, None if alibi is None else alibi.astype(jnp.float32).reshape(1, *s.shape[1:3], 1),
                      kpos[None, None, None, :], pos[:, None, None, None])


def _online_softmax_step(carry, s: jax.Array, mask: jax.Array, pv):
    """Fold one block of keys into (max, denominator, accumulator). s: scores [R, Hkv, G, J];
    mask [R, J]: the keys each query row sees; pv(p): the probabilities times the block's values."""
    m, denom, acc = carry
    s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    alpha = jnp.exp(m - m_safe)
    denom = denom * alpha + p.sum(axis=-1)
    return m_new, denom, acc * alpha[..., None] + pv(p)


def _key_mask(kpos: jax.Array, pos: jax.Array, span: tuple, last: jax.Array | None = None) -> jax.Array:
    """[R, J]: key position kpos [J] is visible to query position pos [R] (causal, or up to `last` [R] where given;
    from its first key on: `span` is (window, chunk), either None, see `first_key`)."""
    return (kpos[None, :] <= (pos if last is None else last)[:, None]) & (
        kpos[None, :] >= first_key(pos, *span)[:, None])


def _init(R: int, Hkv: int, G: int, D: int):
    return (jnp.full((R, Hkv, G), -jnp.inf, jnp.float32), jnp.zeros((R, Hkv, G), jnp.float32),
            jnp.zeros((R, Hkv, G, D), jnp.float32))


def _finish(carry, sinks: jax.Array | None) -> jax.Array:
    """The normalized output [R, Hq, D] of an online softmax's (max, denominator, accumulator) over [R, Hkv, G];
    with `sinks` [Hq], each head's sink in the denominator (a row that saw no key stays zero)."""
    m, denom, acc = carry
    if sinks is not None:
        denom = sink_denom(denom, m, sinks.reshape(m.shape[1:]))
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
    return out.reshape(out.shape[0], -1, out.shape[-1])


def _rows_attention(qf, pos, last, tables, k_pages, v_pages, *, soft_cap, span, pages_per_block, kv_dtype,
                    sinks, alibi):
    """Each query row against its own pages, `pages_per_block` at a time (None: `row_pages_per_block`).
    qf: [R, Hkv, G, D] f32, scaled; pos: [R] (-1: sees no key); last: [R], each row's last visible key, or
    None (causal); tables: [R, P]. Returns [R, Hq, D] f32 (zero for a row that sees no key)."""
    R, Hkv, G, D = qf.shape
    page_size = k_pages.shape[1]
    tables, B = pad_to_blocks(tables, pages_per_block or row_pages_per_block(page_size, Hkv, D, k_pages.dtype.itemsize))
    J = B * page_size
    num_blocks = jnp.minimum((jnp.max(pos if last is None else last) + J) // J, tables.shape[1] // B)

    def body(j, carry):
        pages = jax.lax.dynamic_slice_in_dim(tables, j * B, B, axis=1)  # [R, B]
        k = read_pages(k_pages, pages, kv_dtype).reshape(R, J, Hkv, D)
        v = k if v_pages is None else read_pages(v_pages, pages, kv_dtype).reshape(R, J, Hkv, D)
        kpos = j * J + jnp.arange(J, dtype=jnp.int32)
        mask = _key_mask(kpos, pos, span, last)
        # A masked key may sit in a stale or scratch page: zero its V so 0 * garbage cannot reach the output.
        v = jnp.where(mask[:, :, None, None], v, 0.0)
        s = _scores(jnp.einsum("tkgd,tjkd->tkgj", qf, k), soft_cap, alibi, kpos, pos)
        return _online_softmax_step(carry, s, mask, lambda p: jnp.einsum("tkgj,tjkd->tkgd", p, v))

    return _finish(jax.lax.fori_loop(0, num_blocks, body, _init(R, Hkv, G, D)), sinks)


def token_rows(seq_lens, query_start_loc, num_tokens: int, last_key=None):
    """Per packed token: its sequence, its position and its last visible key (-1 for padding; the key None
    without `last_key`) and whether it is real."""
    seq, pos, valid = token_metadata(seq_lens, query_start_loc, num_tokens)
    last = None if last_key is None else jnp.where(valid, last_key, -1)
    return seq, jnp.where(valid, pos, -1), last, valid  # a padding token sees no key, so its output is zero


def _per_token_attention(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, last_key, *,
                         sm_scale, soft_cap, span, pages_per_block, query_block, kv_dtype, sinks, alibi):
    """Every token gathers its own sequence's pages, one block at a time: all tokens at once when
    they fit in one chunk of `query_block`, else the real tokens a chunk at a time."""
    T, Hq, D = q.shape
    Hkv = k_pages.shape[2] if k_pages.ndim == 4 else 1
    seq, pos, last, valid = token_rows(seq_lens, query_start_loc, T, last_key)
    kw = dict(soft_cap=soft_cap, span=span, pages_per_block=pages_per_block, kv_dtype=kv_dtype, sinks=sinks,
              alibi=alibi)
    if T <= query_block:
        qf = q.astype(jnp.float32).reshape(T, Hkv, Hq // Hkv, D) * sm_scale
        return _rows_attention(qf, pos, last, block_tables[seq], k_pages, v_pages, **kw).astype(q.dtype)
    qf = jnp.pad(q.astype(jnp.float32) * sm_scale, ((0, 1), (0, 0), (0, 0))).reshape(T + 1, Hkv, Hq // Hkv, D)
    # A row whose table starts at the reserved page 0 is padding, or finished in the decode loop.
    live = valid & (block_tables[seq, 0] != 0)
    out = _row_chunks(qf, seq, pos, last, live, block_tables, k_pages, v_pages,
                      jnp.zeros((T + 1, Hq, D), jnp.float32), query_block, **kw)
    return out[:T].astype(q.dtype)


def _row_chunks(qf, seq, pos, last, select, block_tables, k_pages, v_pages, out, chunk, **kw):
    """`_rows_attention` over the selected tokens only, compacted: `chunk` per loop iteration, then the rest
    8, 2 and 1 at a time, so no row is computed for nothing (each row reads its own pages, so smaller
    pieces read no more; a mixed step's few decode tokens cost those few rows).

    qf: [T + pad, Hkv, G, D] with at least one row of padding; seq, pos, last (or None), select: [T]; out: [T + pad,
    Hq, D], returned with the selected rows written."""
    T = seq.shape[0]
    count = jnp.sum(select)
    order = jnp.pad(jnp.argsort(~select, stable=True).astype(jnp.int32), (0, chunk), constant_values=T)

    def rows_from(first, n, out):
        idx = jax.lax.dynamic_slice_in_dim(order, first, n)
        o = _rows_attention(qf[idx], pos[idx], None if last is None else last[idx], block_tables[seq[idx]],
                            k_pages, v_pages, **kw)
        return out.at[idx].set(o)

    first = jnp.int32(0)
    for size in sorted({s for s in (chunk, SMALL_BLOCK, 2, 1) if s <= chunk}, reverse=True):
        n = (count - first) // size
        out = jax.lax.fori_loop(0, n, lambda c, out, f=first, size=size: rows_from(f + c * size, size, out), out)
        first = first + n * size
    return out


def _tiled_attention(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, last_key, *,
                     sm_scale, soft_cap, span, pages_per_block, query_block, kv_dtype, sinks, alibi):
    """A mixed batch. Each prompt chunk (a sequence with several query tokens) goes in tiles of
    `query_block` tokens; a tile reads each block of its sequence's pages once for all its tokens.
    Decode tokens (one query token in their sequence) go `query_block` at a time, each reading its own
    pages. Loops run over the real tiles and chunks, and over the blocks of keys they can see."""
    T, Hq, D = q.shape
    page_size, Hkv = k_pages.shape[1], k_pages.shape[2] if k_pages.ndim == 4 else 1
    S = block_tables.shape[0]
    G, Bq = Hq // Hkv, query_block
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    # The token axis gets a tile of padding, so a tile's window never runs off its end (a dynamic slice
    # would shift it back instead).
    qf = jnp.pad(q.astype(jnp.float32) * sm_scale, ((0, Bq), (0, 0), (0, 0))).reshape(T + Bq, Hkv, G, D)
    kw = dict(soft_cap=soft_cap, span=span, pages_per_block=pages_per_block, kv_dtype=kv_dtype, sinks=sinks,
              alibi=alibi)
    tables, B = pad_to_blocks(block_tables, pages_per_block or TILE_PAGES_PER_BLOCK)  # the tiles' blocks of pages
    J = B * page_size

    # Decode tokens, compacted: chunks of Bq, then pieces of 8, 2 and 1.
    seq, pos, last_all, valid = token_rows(seq_lens, query_start_loc, T, last_key)
    out = _row_chunks(qf, seq, pos, last_all, valid & (q_lens[seq] == 1), block_tables, k_pages, v_pages,
                      jnp.zeros((T + Bq, Hq, D), jnp.float32), Bq, **kw)
    if last_all is not None:  # padded as qf is, for the tiles' windows
        last_all = jnp.pad(last_all, (0, Bq), constant_values=-1)

    # Prompt chunks, in tiles of Bq; a chunk's last partial tile of at most SMALL_BLOCK tokens (a short chunk:
    # verified drafts, a prompt's tail) in a tile of that size.
    small = min(SMALL_BLOCK, Bq)
    rem = q_lens % Bq
    chunked = q_lens > 1
    big_tiles = jnp.where(chunked, q_lens // Bq + (rem > small), 0)  # [S]
    small_tiles = jnp.where(chunked & (rem > 0) & (rem <= small), 1, 0)

    def tiles(out, per_seq, num, rows_per_tile, q0_of):
        """`per_seq` [S] tiles of `rows_per_tile` queries per sequence, the k-th at query `q0_of(seq, k)`;
        `num` (static) bounds their count."""
        ends = jnp.cumsum(per_seq)
        i = jnp.arange(num, dtype=jnp.int32)
        tile_seq = jnp.minimum(jnp.searchsorted(ends, i, side="right"), S - 1).astype(jnp.int32)
        tile_q0 = q0_of(tile_seq, i - (ends - per_seq)[tile_seq])
        rows = jnp.arange(rows_per_tile, dtype=jnp.int32)

        def tile(t, out):
            s, q0 = tile_seq[t], tile_q0[t]
            start = query_start_loc[s] + q0
            ctx = seq_lens[s] - q_lens[s]  # tokens before this step's queries
            real = q0 + rows < q_lens[s]
            pos = jnp.where(real, ctx + q0 + rows, -1)  # [rows_per_tile]
            qt = jax.lax.dynamic_slice_in_dim(qf, start, rows_per_tile)
            last = ctx + jnp.minimum(q0 + rows_per_tile, q_lens[s])  # keys [first, last) are all the tile sees
            row_last = None
            if last_all is not None:  # spans attended both ways reach further
                row_last = jnp.where(real, jax.lax.dynamic_slice_in_dim(last_all, start, rows_per_tile), -1)
                last = jnp.maximum(last, jnp.max(row_last) + 1)
            first = jnp.maximum(first_key(ctx + q0, *span), 0)
            table = tables[s]

            def block(j, carry):
                pages = jax.lax.dynamic_slice_in_dim(table, j * B, B)  # [B]
                k = read_pages(k_pages, pages, kv_dtype).reshape(J, Hkv, D)
                v = k if v_pages is None else read_pages(v_pages, pages, kv_dtype).reshape(J, Hkv, D)
                kpos = j * J + jnp.arange(J, dtype=jnp.int32)
                # Keys outside [first, last) may sit in stale or scratch pages: zero their V (no row sees them).
                v = jnp.where(((kpos >= first) & (kpos < last))[:, None, None], v, 0.0)
                s = _scores(jnp.einsum("qkgd,jkd->qkgj", qt, k), soft_cap, alibi, kpos, pos)
                mask = _key_mask(kpos, pos, span, row_last)
                return _online_softmax_step(carry, s, mask, lambda p: jnp.einsum("qkgj,jkd->qkgd", p, v))

            init = _init(rows_per_tile, Hkv, G, D)
            done = _finish(jax.lax.fori_loop(first // J, (last + J - 1) // J, block, init), sinks)
            new = jnp.where(real[:, None, None], done,
                            jax.lax.dynamic_slice_in_dim(out, start, rows_per_tile))
            return jax.lax.dynamic_update_slice_in_dim(out, new, start, axis=0)

        return jax.lax.fori_loop(0, ends[-1], tile, out)

    # At most one partial tile per sequence.
    out = tiles(out, big_tiles, -(-T // Bq) + S, Bq, lambda s, k: k * Bq)
    out = tiles(out, small_tiles, S, small, lambda s, k: q_lens[s] // Bq * Bq)
    return out[:T].astype(q.dtype)


def paged_attention(
    backend: AttentionBackend,
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array | None,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    last_key: jax.Array | None = None,
    decode: bool = False,
    kv_dtype=None,
    sinks: jax.Array | None = None,
    layout=None,
    chunk: int | None = None,
    kv_copies: int = 1,
    alibi: jax.Array | None = None,
) -> jax.Array:
    """Dispatch to the chosen attention backend (all share the xla backend's contract). `decode`
    (static) promises at most one query token per sequence; `kv_dtype`, for the xla backend, is what
    pools of raw bits hold; `last_key` [T]: spans attended both ways; `sinks` [Hq]: attention-sink logits;
    `layout` (a `sharding.MeshLayout`): the mesh axis the kernels split heads over (see `on_head_shards`); `chunk`:
    Llama 4's chunked attention (a query sees no key before its chunk of positions); `kv_copies`: the pools hold each
    KV head that many times over (Gemma 4's full-attention rows): the Pallas kernel reads one where it can; `alibi`
    [Hq]: ALiBi's slopes."""
    kwargs = dict(sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window)
    if backend == "xla":
        return xla_ragged_paged_attention(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, chunk=chunk,
                                          decode=decode, kv_dtype=kv_dtype, last_key=last_key, sinks=sinks, alibi=alibi,
                                          **kwargs)
    if backend in ("pallas", "pallas_interpret", "pallas_mosaic", "pallas_mosaic_interpret"):
        from pallas_kernels import AttentionTuning, ragged_paged_attention
        lowering = "mosaic" if backend.startswith("pallas_mosaic") else "triton"
        tuning = AttentionTuning(decode_lowering=lowering, prefill_lowering=lowering)

        def kernel(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, last_key, sinks, alibi):
            return ragged_paged_attention(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc,
                                          interpret=backend.endswith("_interpret"), tuning=tuning, last_key=last_key,
                                          sinks=sinks, alibi=alibi, decode=decode, attention_chunk=chunk, **kwargs,
                                          kv_copies=kv_copies if k_pages.shape[2] % kv_copies == 0 else 1)

        return on_head_shards(layout, kernel, q, (k_pages, v_pages),
                              (block_tables, seq_lens, query_start_loc, last_key), (sinks, alibi))
    raise ValueError(f"unknown attention backend {backend!r} (choose from {', '.join(ATTENTION_BACKENDS)})")
