"""Helpers for the kernel tests (no tests here): random ragged batches and a naive numpy oracle."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass
class Batch:
    """Inputs of one ragged paged attention call, plus what the tests need to check it."""

    q: jnp.ndarray  # [T, QH, D]
    k_pages: jnp.ndarray  # [num_pages, page_size, KVH, D]
    v_pages: jnp.ndarray
    block_tables: jnp.ndarray  # [S, P] int32
    seq_lens: jnp.ndarray  # [S] int32
    query_start_loc: jnp.ndarray  # [S + 1] int32
    num_real_tokens: int


def make_batch(
    rng,
    *,
    page_size,
    head_dim,
    group,
    num_kv_heads,
    dtype,
    seqs,
    pages_per_seq,
    num_pages=None,
    pad_tokens=3,
    pad_seqs=1,
) -> Batch:
    """`seqs` is [(q_len, kv_len)]; pages are drawn with replacement so sequences share pages.

    Page 0 (scratch) is filled with NaN and every table entry past a sequence's pages points at it, so a
    kernel that reads a KV row it should not use produces NaN.
    """
    seqs = list(seqs) + [(0, 0)] * pad_seqs
    num_pages = num_pages or max(4, len(seqs) * pages_per_seq // 2)
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    k[0] = np.nan
    v[0] = np.nan
    tables = np.zeros((len(seqs), pages_per_seq), np.int32)
    for s, (q_len, kv_len) in enumerate(seqs):
        assert q_len <= kv_len <= pages_per_seq * page_size, (q_len, kv_len)
        used = -(-kv_len // page_size)
        tables[s, :used] = rng.integers(1, num_pages, used)
    q_lens = np.array([q for q, _ in seqs], np.int32)
    total = int(q_lens.sum())
    q = rng.standard_normal((total + pad_tokens, num_kv_heads * group, head_dim)).astype(np.float32)
    return Batch(
        q=jnp.asarray(q, dtype),
        k_pages=jnp.asarray(k, dtype),
        v_pages=jnp.asarray(v, dtype),
        block_tables=jnp.asarray(tables),
        seq_lens=jnp.asarray([kv for _, kv in seqs], jnp.int32),
        query_start_loc=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
        num_real_tokens=total,
    )


# Spans attended both ways (`last_key`): positions (first, last) per sequence, for `SPAN_SEQS`. They cross page
# and query-block boundaries, start before the step's chunk (an image partly cached), end at the chunk's end,
# sit back to back (0 and 1 text tokens apart) and several in one chunk; decode tokens and a plain chunk beside.
SPAN_SEQS = [(40, 40), (1, 17), (20, 52), (30, 30), (6, 9)]
SPANS = [[(3, 13), (14, 20), (22, 31), (33, 34)], [], [(28, 41), (45, 51)], [(0, 29)], [(4, 8)]]


def span_last_key(b: Batch, spans_per_seq, rng=None) -> jnp.ndarray:
    """`last_key` for the batch: a token inside one of its sequence's spans (inclusive (first, last) positions)
    sees up to the span's last position, any other token its own position; padding tokens get junk, and with
    `rng` a few causal tokens get a value below their position (both count as their position)."""
    seq_lens, qsl = np.asarray(b.seq_lens), np.asarray(b.query_start_loc)
    last = np.full(b.q.shape[0], 10**6, np.int32)
    for s, spans in enumerate(spans_per_seq):
        q_len = qsl[s + 1] - qsl[s]
        for i in range(q_len):
            pos = seq_lens[s] - q_len + i
            ends = [e for a, e in spans if a <= pos <= e]
            low = rng is not None and rng.random() < 0.2
            last[qsl[s] + i] = ends[0] if ends else (pos - 3 if low else pos)
    return jnp.asarray(last)


def naive_attention(b: Batch, *, sm_scale, soft_cap=None, sliding_window=None, last_key=None, sinks=None,
                    attention_chunk=None, alibi=None) -> np.ndarray:
    """Loop-per-token float64 attention straight from the contract; independent of the library's reference.
    `sinks` [QH]: each head's sink logit, a share of the softmax with no value; `attention_chunk`: no key before
    the token's chunk of positions; `alibi` [QH]: each head's slope times each key's position less the token's."""
    q = np.asarray(b.q, np.float64)
    k = np.asarray(b.k_pages, np.float64)
    v = np.asarray(b.v_pages, np.float64)
    tables = np.asarray(b.block_tables)
    seq_lens = np.asarray(b.seq_lens)
    qsl = np.asarray(b.query_start_loc)
    page_size, num_kv_heads = k.shape[1], k.shape[2]
    group = q.shape[1] // num_kv_heads
    out = np.zeros_like(q)
    for s in range(len(seq_lens)):
        q_len = qsl[s + 1] - qsl[s]
        for i in range(q_len):
            t = qsl[s] + i
            pos = seq_lens[s] - q_len + i
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            if attention_chunk is not None:
                lo = max(lo, pos // attention_chunk * attention_chunk)
            last = pos if last_key is None else min(max(pos, int(last_key[t])), seq_lens[s] - 1)
            kv = np.arange(lo, last + 1)
            pages = tables[s, kv // page_size]
            for h in range(q.shape[1]):
                kh = h // group
                logits = k[pages, kv % page_size, kh] @ q[t, h] * sm_scale
                if soft_cap is not None:
                    logits = soft_cap * np.tanh(logits / soft_cap)
                if alibi is not None:
                    logits = logits + float(alibi[h]) * (kv - pos)
                top = logits.max() if sinks is None else max(logits.max(), float(sinks[h]))
                p = np.exp(logits - top)
                denom = p.sum() + (0.0 if sinks is None else np.exp(float(sinks[h]) - top))
                out[t, h] = (p / denom) @ v[pages, kv % page_size, kh]
    return out


def standard_seqs(page_size: int, pages_per_seq: int):
    """Query/KV lengths at and around page boundaries, prefill and decode mixed, plus a full page table."""
    ps = page_size
    full = pages_per_seq * ps
    return [
        (1, ps - 1),
        (1, ps),
        (1, ps + 1),  # decode across a page boundary
        (2 * ps + 1, 2 * ps + 1),  # whole prompt, several pages
        (ps, 3 * ps),  # a prefill chunk after cached context
        (1, 1),  # first token
        (3, full),  # full page table
        (ps - 1, 2 * ps - 1),
    ]
