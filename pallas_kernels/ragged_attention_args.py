"""The argument contract of ragged paged attention, shared by the reference and the kernels.

Query tokens `q [num_tokens, num_q_heads, head_dim]` are packed by sequence: sequence `s` owns tokens
`query_start_loc[s] : query_start_loc[s + 1]`, and its KV lives in the pages `block_tables[s]` of the pools
`[num_pages, page_size, num_kv_heads, head_dim]` up to `seq_lens[s]`. Tokens past `query_start_loc[-1]` are
padding. The pages may be stored in another float dtype than q (float8 to halve a bfloat16 cache); the
kernels upcast what they load. `check_attention_args` refuses arguments that break this contract;
`token_metadata` maps each packed token back to its sequence and position.

A token sees the keys up to its own position (causal), or with `last_key` (`[num_tokens]` int32) up to
`last_key[t]`: the tokens of a span attended both ways (an image in Gemma 3) see up to the span's last position,
the keys of their own span that come after them included. `last_key` below a token's position or past its
sequence's last position counts as the nearest of the two; the sliding window stays behind the token's position.
With `attention_chunk` (Llama 4's chunked attention) a token sees no key before its chunk of positions
(`pos - pos % attention_chunk`); a window and chunks may be given together (the later first key counts).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

# The float8 formats a KV page may be stored in (one byte an element); the kernels upcast on load.
FP8_KV_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
_KV_PAGE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), *FP8_KV_DTYPES)
# Every kernel's running row max starts at this finite floor rather than -inf: a row that sees no key of a
# block (its window starts past the block, or it is a padding row) keeps m at the floor, and exp(-inf - floor)
# is 0 where exp(-inf - -inf) would be NaN. Real logits are far above it.
M_FLOOR = -1e30


def check_kv_page_dtype(page_dtype, q_dtype) -> None:
    """KV pages hold q's dtype, another 16/32-bit float (bfloat16 pages under float32 queries), or float8."""
    page_dtype = jnp.dtype(page_dtype)
    if page_dtype == jnp.dtype(q_dtype) or page_dtype in _KV_PAGE_DTYPES:
        return
    raise TypeError(
        f"k_pages dtype {page_dtype} cannot serve q of dtype {jnp.dtype(q_dtype)}: pages hold q's dtype, "
        "float32, bfloat16, float16, float8_e4m3fn or float8_e5m2"
    )


def quantize_kv(x: jax.Array, page_dtype) -> jax.Array:
    """New K or V rows in the pages' dtype. Float8 saturates at the format's largest finite value (a plain
    cast of an out-of-range value to float8_e4m3fn gives NaN, which would poison every later query)."""
    page_dtype = jnp.dtype(page_dtype)
    if page_dtype == x.dtype:
        return x
    if page_dtype in FP8_KV_DTYPES:
        top = float(jnp.finfo(page_dtype).max)
        return jnp.clip(x.astype(jnp.float32), -top, top).astype(page_dtype)
    return x.astype(page_dtype)


def check_attention_args(
    q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, sm_scale, soft_cap, sliding_window, last_key=None,
    sinks=None, attention_chunk=None, kv_copies=1, alibi=None,
) -> None:
    """Raise ValueError/TypeError with a specific message when the arguments break the contract."""
    if q.ndim != 3:
        raise ValueError(f"q must be [num_tokens, num_q_heads, head_dim], got shape {q.shape}")
    if k_pages.ndim != 4:
        raise ValueError(
            f"k_pages must be [num_pages, page_size, num_kv_heads, head_dim], got {k_pages.shape}"
        )
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages shape {v_pages.shape} differs from k_pages shape {k_pages.shape}")
    if k_pages.dtype != v_pages.dtype:
        raise TypeError(f"k_pages dtype {k_pages.dtype} differs from v_pages dtype {v_pages.dtype}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise TypeError(f"q must be floating point, got {q.dtype}")
    check_kv_page_dtype(k_pages.dtype, q.dtype)
    _, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, kv_head_dim = k_pages.shape
    if kv_head_dim != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) differs from head_dim of the pages ({kv_head_dim})")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if kv_copies < 1 or num_kv_heads % kv_copies:
        raise ValueError(f"kv_copies ({kv_copies}) must divide the pages' {num_kv_heads} KV heads (each head held "
                         f"kv_copies times over)")
    if num_pages < 1:
        raise ValueError("k_pages must hold at least the scratch page 0")
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables must be [num_seqs, pages_per_seq], got shape {block_tables.shape}")
    num_seqs = block_tables.shape[0]
    if seq_lens.shape != (num_seqs,):
        raise ValueError(f"seq_lens must be [{num_seqs}] (one per block_tables row), got {seq_lens.shape}")
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(
            f"query_start_loc must be [{num_seqs + 1}] (num_seqs + 1), got {query_start_loc.shape}"
        )
    for name, a in (
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc),
    ):
        if a.dtype != jnp.int32:
            raise TypeError(f"{name} must be int32, got {a.dtype}")
    if last_key is not None and (last_key.shape != q.shape[:1] or last_key.dtype != jnp.int32):
        raise ValueError(f"last_key must be int32 [{q.shape[0]}] (one per query token), got {last_key.dtype} "
                         f"{last_key.shape}")
    if sinks is not None and (sinks.shape != (num_q_heads,) or not jnp.issubdtype(sinks.dtype, jnp.floating)):
        raise ValueError(f"sinks must be a float [{num_q_heads}] (one logit per query head), got {sinks.dtype} "
                         f"{sinks.shape}")
    if alibi is not None and (alibi.shape != (num_q_heads,) or not jnp.issubdtype(alibi.dtype, jnp.floating)):
        raise ValueError(f"alibi must be a float [{num_q_heads}] (one ALiBi slope per query head), got {alibi.dtype} "
                         f"{alibi.shape}")
    check_score_args(sm_scale, soft_cap, sliding_window, attention_chunk)


def check_score_args(sm_scale, soft_cap, sliding_window, attention_chunk=None) -> None:
    """Raise ValueError naming the problem when the scale, soft-cap, window or chunk is out of range."""
    if not sm_scale > 0:
        raise ValueError(f"sm_scale must be positive, got {sm_scale}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be positive or None, got {soft_cap}")
    if sliding_window is not None and (int(sliding_window) != sliding_window or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window}")
    if attention_chunk is not None and (int(attention_chunk) != attention_chunk or attention_chunk < 1):
        raise ValueError(f"attention_chunk must be a positive int or None, got {attention_chunk}")


def logits(s, sm_scale: float, soft_cap: float | None, log_base: float = 1.0):
    """The scores `s` scaled, soft-capped (`cap * tanh(x / cap)`) when `soft_cap` is set, times `log_base`
    (log2(e) for a softmax in base 2)."""
    if soft_cap is None:
        return s * (sm_scale * log_base)
    return jnp.tanh(s * (sm_scale / soft_cap)) * (soft_cap * log_base)


def alibi_bias(s, slopes, key_pos, row_pos):
    """The scores `s` [rows, keys] plus ALiBi's linear bias, `slopes` [rows, 1] times each key's distance back from
    its row, `key_pos - row_pos` (BLOOM's bias on the key's position alone differs by a constant per row: the same
    softmax); None slopes: `s` unchanged."""
    return s if slopes is None else s + slopes * (key_pos - row_pos).astype(jnp.float32)


def mask_keys(s, key_pos, row_pos, window: int | None, row_last=None, chunk: int | None = None):
    """`s` with -inf where a row does not see a key: keys past its position (causal), or past `row_last` where
    given (a span attended both ways), or before its first key (`first_key`: a sliding window, a chunk)."""
    s = jnp.where(key_pos <= (row_pos if row_last is None else row_last), s, -jnp.inf)
    if window is not None:
        s = jnp.where(key_pos > row_pos - window, s, -jnp.inf)
    if chunk is not None:  # each bound on its own: no constant tile to lay out in the Mosaic GPU kernels
        s = jnp.where(key_pos >= row_pos - lax.rem(row_pos, chunk), s, -jnp.inf)
    return s


def first_key(pos, window: int | None, chunk: int | None = None):
    """The first key position `pos` sees: 0, or with a sliding window `pos - window + 1` (negative near the start:
    clamp it where it indexes), or with chunked attention the start of its chunk, whichever is later.
    Nondecreasing in `pos`."""
    if window is None and chunk is None:
        return jnp.zeros_like(pos)
    first = None if window is None else pos - window + 1
    if chunk is not None:
        start = pos - lax.rem(pos, chunk)
        first = start if first is None else jnp.maximum(first, start)
    return first


def window_start(pos, window: int | None, block_kv: int, chunk: int | None = None):
    """The first KV block holding a key that position `pos` sees."""
    if window is None and chunk is None:
        return jnp.zeros_like(pos)
    return lax.div(jnp.maximum(first_key(pos, window, chunk), 0), block_kv)


def key_capacity(capacity: int, window: int | None, chunk: int | None, rows_span: int, block_kv: int) -> int:
    """The keys a block of queries `rows_span` positions long can read of a `capacity`-key sequence, bounded by
    a window or a chunk (plus one partial KV block)."""
    for reach in (window, chunk):
        if reach is not None:
            capacity = min(capacity, reach + (rows_span - 1) + block_kv)
    return capacity


def token_metadata(
    seq_lens: jax.Array, query_start_loc: jax.Array, num_tokens: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per packed query token: its sequence, its position, and whether it is a real token (not padding).

    Each result is `[num_tokens]` int32 / int32 / bool; a padding token is filed under the last sequence.
    """
    num_seqs = seq_lens.shape[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    tok_seq = jnp.searchsorted(query_start_loc[1:], t, side="right").astype(jnp.int32)
    tok_seq = jnp.minimum(tok_seq, num_seqs - 1)
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    pos = seq_lens[tok_seq] - q_lens[tok_seq] + (t - query_start_loc[tok_seq])
    valid = t < query_start_loc[num_seqs]
    return tok_seq, pos, valid


def clamp_last_key(last_key, seq_lens, query_start_loc, num_tokens: int):
    """`last_key` held to the contract's range, [its token's position, its sequence's last position]; None
    stays None."""
    if last_key is None:
        return None
    tok_seq, pos, _ = token_metadata(seq_lens, query_start_loc, num_tokens)
    return jnp.clip(last_key, pos, jnp.maximum(seq_lens[tok_seq] - 1, pos))


# The spans attended both ways that one query block of a Mosaic GPU kernel can hold: those kernels read each
# block's spans from its metadata (row r sees up to the end of the span holding it) rather than a vector per
# row; a batch with a block that meets more goes to the generic kernel.
BLOCK_SPANS = 2


def block_spans(last_key, seq_lens, query_start_loc, gather_tok, meta):
    """Per query block, its first and its last span attended both ways, as metadata columns
    `(start, end, start, end)` (positions; an absent span is (0, -1)), and whether any block meets more than
    `BLOCK_SPANS` spans. `last_key` is clamped (`clamp_last_key`); a token with `last_key` past its position
    belongs to the span ending there (a span's last token, seeing no further, is causal anyway)."""
    num_tokens = last_key.shape[0]
    _, pos, _ = token_metadata(seq_lens, query_start_loc, num_tokens)
    block_q = gather_tok.shape[1]
    real = jnp.arange(block_q, dtype=jnp.int32)[None, :] < meta[:, 2:3]  # [NB, BQ]
    tok_pos, tok_last = pos[gather_tok], last_key[gather_tok]
    inside = real & (tok_last > tok_pos)
    big = jnp.iinfo(jnp.int32).max
    lasts = jnp.where(inside, tok_last, -1)
    end0 = jnp.min(jnp.where(inside, tok_last, big), axis=1)
    end1 = jnp.max(lasts, axis=1)
    start0 = jnp.min(jnp.where(inside & (tok_last == end0[:, None]), tok_pos, big), axis=1)
    start1 = jnp.min(jnp.where(inside & (tok_last == end1[:, None]), tok_pos, big), axis=1)
    # Ends are nondecreasing along a block: a new span starts where a token's end exceeds all before it.
    before = jnp.pad(lax.cummax(lasts, axis=1)[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
    count = jnp.sum(inside & (lasts > before), axis=1)
    some = jnp.any(inside, axis=1)
    two = some & (end1 != end0)
    spans = jnp.stack([jnp.where(some, start0, 0), jnp.where(some, end0, -1),
                       jnp.where(two, start1, 0), jnp.where(two, end1, -1)], axis=1).astype(jnp.int32)
    return spans, jnp.any(count > BLOCK_SPANS)


def meta_spans(meta_ref, blk) -> tuple:
    """The spans `block_spans` put in a block's metadata row (columns 4 on), as scalar (start, end) pairs; none
    when the metadata has only the four columns of `block_layout`."""
    if meta_ref.shape[1] <= 4:
        return ()
    return tuple((meta_ref[blk, 4 + 2 * i], meta_ref[blk, 5 + 2 * i]) for i in range(BLOCK_SPANS))


def span_last(row_pos, spans):
    """Each row's last visible key: the end of the span (`(start, end)` scalar pairs) holding its position,
    else its position."""
    last = row_pos
    for start, end in spans:
        last = jnp.where((row_pos >= start) & (row_pos <= end), end, last)
    return last


# Rows a tile needs for tensor-core dots; smaller tiles go without them unless padded.
MMA_MIN_ROWS = 16


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def row_tiling(block_q: int, heads: int, pad_to_mma: bool, num_tokens: int, num_seqs: int) -> tuple[int, bool, int]:
    """A program's query rows (`block_q` tokens x `heads` heads, to a power of two, and at least `MMA_MIN_ROWS`
    where tensor-core dots are used), whether they are, and how many query blocks `block_layout` makes."""
    rows = next_pow2(block_q * heads)
    use_mma = rows >= MMA_MIN_ROWS or pad_to_mma
    if use_mma:
        rows = max(rows, MMA_MIN_ROWS)
    num_blocks = min(num_tokens, -(-num_tokens // block_q) + (num_seqs if block_q > 1 else 0))
    return rows, use_mma, num_blocks


def block_layout(seq_lens, query_start_loc, num_tokens: int, block_q: int, skip=None):
    """Cut each sequence's query tokens into blocks of `block_q`; returns per-block and per-token maps.
    The sequences marked in `skip` (`[S]` bool) get no blocks, and their tokens count as padding."""
    num_seqs = seq_lens.shape[0]
    # Every non-empty block holds a token, and each sequence wastes at most one partial block.
    num_blocks = min(num_tokens, -(-num_tokens // block_q) + (num_seqs if block_q > 1 else 0))
    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # [S]
    blocks_per_seq = (q_lens + block_q - 1) // block_q
    if skip is not None:
        blocks_per_seq = jnp.where(skip, 0, blocks_per_seq)
    blk_end = jnp.cumsum(blocks_per_seq).astype(jnp.int32)  # [S]
    blk_start = blk_end - blocks_per_seq

    b = jnp.arange(num_blocks, dtype=jnp.int32)
    b_seq = jnp.minimum(jnp.searchsorted(blk_end, b, side="right").astype(jnp.int32), num_seqs - 1)
    q_off = (b - blk_start[b_seq]) * block_q  # first query index of the block within its sequence
    num_q = jnp.clip(q_lens[b_seq] - q_off, 0, block_q)
    if skip is not None:  # the blocks past the last one (filed under the last sequence) stay empty too
        num_q = jnp.where(skip[b_seq], 0, num_q)
    pos0 = seq_lens[b_seq] - q_lens[b_seq] + q_off
    meta = jnp.stack([b_seq, pos0, num_q, jnp.zeros_like(b)], axis=1)  # [NB, 4]

    r = jnp.arange(block_q, dtype=jnp.int32)
    gather_tok = jnp.clip(query_start_loc[b_seq][:, None] + q_off[:, None] + r[None, :], 0, num_tokens - 1)

    tok_seq, _, tok_valid = token_metadata(seq_lens, query_start_loc, num_tokens)
    if skip is not None:
        tok_valid &= ~skip[tok_seq]
    i = jnp.arange(num_tokens, dtype=jnp.int32) - query_start_loc[tok_seq]
    tok_block = jnp.clip(blk_start[tok_seq] + i // block_q, 0, num_blocks - 1)
    tok_row = i % block_q
    return num_blocks, meta, gather_tok, tok_block, tok_row, tok_valid


def queries_to_blocks(q: jax.Array, gather_tok: jax.Array, num_kv_heads: int, rows: int) -> jax.Array:
    """q `[T, QH, D]` as one `[rows, D]` tile per (block, KV head): the block's tokens (`gather_tok`
    `[NB, BQ]`), each with the query heads of the KV head's group, zero-padded to `rows`."""
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    num_blocks, block_q = gather_tok.shape
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)[gather_tok]  # [NB, BQ, KVH, G, D]
    qb = qg.transpose(0, 2, 1, 3, 4).reshape(num_blocks, num_kv_heads, block_q * group, head_dim)
    return jnp.pad(qb, ((0, 0), (0, 0), (0, rows - block_q * group), (0, 0)))


def blocks_to_tokens(ob: jax.Array, tok_block, tok_row, tok_valid, block_q: int, group: int) -> jax.Array:
    """The inverse of `queries_to_blocks` on the output tiles `[NB, KVH, rows, D]`: `[T, QH, D]`, padding
    tokens zero."""
    num_blocks, num_kv_heads, _, head_dim = ob.shape
    ob = ob[:, :, : block_q * group].reshape(num_blocks, num_kv_heads, block_q, group, head_dim)
    out = ob[tok_block, :, tok_row]  # [T, KVH, G, D]
    out = jnp.where(tok_valid[:, None, None, None], out, jnp.zeros((), out.dtype))
    return out.reshape(out.shape[0], num_kv_heads * group, head_dim)


def combine_splits(acc: jax.Array, m: jax.Array, denom: jax.Array, sinks: jax.Array | None = None) -> jax.Array:
    """Flash-decoding partials of the KV splits (axis 0): unnormalized accumulators `[NS, ..., D]`, row maxima
    and row sums `[NS, ...]` -> the normalized output `[..., D]` float32 (rows with no key: zero). `sinks`
    (broadcast to the rows `[...]`): each row's attention-sink logit, in the denominator once (`sink_denom`)."""
    m_max = jnp.max(m, axis=0)
    w = jnp.exp(m - m_max[None])
    l_sum = jnp.sum(w * denom, axis=0)
    if sinks is not None:
        l_sum = sink_denom(l_sum, m_max, sinks)
    return jnp.sum(w[..., None] * acc, axis=0) / jnp.where(l_sum == 0.0, 1.0, l_sum)[..., None]


def head_pieces(head_dim: int) -> tuple[tuple[int, int], ...]:
    """A head's dims as (offset, width) parts of power-of-two widths, widest first (96: (0, 64), (64, 32)): the
    Triton lowering's blocks are powers of two."""
    widths = [1 << b for b in reversed(range(head_dim.bit_length())) if head_dim >> b & 1]
    return tuple((sum(widths[:i]), w) for i, w in enumerate(widths))


def store_rows(out_refs, acc, m, denom, num_splits: int, sinks=None, pieces=None) -> None:
    """A program's end: with one split, its rows normalized into the one output ref (`sinks`: each row's
    attention-sink logit, in the denominator); else its unnormalized accumulator, row maxima and row sums, for
    `combine_splits`. With `pieces` (`head_pieces`), `acc` is one accumulator a part, each stored to its dims."""
    parts = tuple(zip(pieces, acc, strict=True)) if pieces is not None else (((0, acc.shape[1]), acc),)
    if num_splits == 1:
        (o_ref,) = out_refs
        if sinks is not None:
            denom = sink_denom(denom, m, sinks)
        for (o, w), a in parts:
            o_ref[:, pl.ds(o, w)] = (a / jnp.where(denom == 0.0, 1.0, denom)[:, None]).astype(o_ref.dtype)
    else:
        o_ref, m_ref, l_ref = out_refs
        for (o, w), a in parts:
            o_ref[:, pl.ds(o, w)] = a
        m_ref[...] = m
        l_ref[...] = denom


def sink_denom(denom: jax.Array, m: jax.Array, sinks: jax.Array) -> jax.Array:
    """An online softmax's denominator (over scores whose running max is `m`) with each row's attention sink
    (gpt-oss): a logit that joins the softmax and takes its share of the weight but has no value. A row that saw
    no key (`m` at -inf or `M_FLOOR`) gets an infinite denominator, so its output stays zero."""
    return denom + jnp.exp(sinks.astype(jnp.float32) - m)


def default_splits(num_blocks: int, num_kv_heads: int, kv_capacity: int, block_kv: int) -> int:
    """Flash-decoding splits for `num_blocks` query blocks (one token each: decode): doubled while the programs
    fill under two waves of the H200's 132 SMs and each split keeps at least 4 KV blocks of `kv_capacity`
    keys, at most 32."""
    programs = num_blocks * num_kv_heads
    max_useful = max(1, kv_capacity // (4 * block_kv))
    splits = 1
    while splits * 2 <= min(32, max_useful) and programs * splits < 2 * 132:
        splits *= 2
    return splits


def block_splits(num_blocks: int, num_seqs: int, num_kv_heads: int, kv_capacity: int, block_kv: int, rows: int,
                 head_dim: int, kv_itemsize: int) -> int:
    """`default_splits` for query blocks of several tokens (`rows` query rows each), halved while the float32
    partials the splits write would exceed a quarter of the K/V bytes the `num_seqs` sequences can hold: a
    short step over long contexts (drafts verified as chunks) splits, a prefill of many blocks does not."""
    splits = default_splits(num_blocks, num_kv_heads, kv_capacity, block_kv)
    kv_bytes = num_seqs * kv_capacity * num_kv_heads * head_dim * 2 * kv_itemsize
    while splits > 1 and splits * num_blocks * num_kv_heads * rows * head_dim * 4 * 4 > kv_bytes:
        splits //= 2
    return splits
