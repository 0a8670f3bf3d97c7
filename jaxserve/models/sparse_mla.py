"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5; `config_mla.DSA_FAMILIES`): a lightning indexer scores every key
a token can see, and the token's latent attention (`models.mla`) reads only the `index_topk` best.

The indexer has `index_heads` query heads (from the queries' bottleneck) and one key per token (LayerNormed), both
turned by position over their first `rotary_dims` dims; the key rides in the token's page entry after the latent and
the rotary key, so prefix caching, preemption and KV transfer carry it as they carry the rest. Key j's score for a
query: sum over heads h of w_h * relu(q_h . k_j / sqrt(Di)), w the query token's head weights over sqrt(heads), in
float32. A token that sees at most `index_topk` keys attends all of them (the dense MLA); past that, the best ones.

On the xla backend the choice runs in plain JAX: rows of tokens walk their sequences' pages in blocks, keeping each
row's running best `index_topk` (score, position); the attention over the chosen entries (as the MLA attends its
pages, their latent part the values) follows in XLA. On the Pallas backends the indexer kernel
(`pallas_kernels.sparse_index`) scores every key a token sees at once, `lax.top_k` takes each row's best, and the
sparse latent kernel (`pallas_kernels.sparse_latent_attention`) attends them, each device over its own KV heads.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.models.attention import pad_to_blocks, token_rows
from jaxserve.models.head_shards import on_head_shards
from jaxserve.models.kv_pages import read_pages
from jaxserve.models.ops import apply_rope, layer_norm
from jaxserve.models.params import LayerParams

INDEX_KEY_NORM_EPS = 1e-6  # the indexer key's LayerNorm (transformers': fixed)
ROWS = 8  # query tokens per loop iteration
BLOCK_KEYS = 256  # keys scored per block (whole pages, at least one)
SCORE_BYTES = 256 << 20  # the indexer kernel's scores at once, at most (`scored_keys`)


def index_queries(cfg: ModelConfig, lp: LayerParams, h: jax.Array, h_q: jax.Array, cos: jax.Array, sin: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
    """The indexer's queries [T, Hi, Di] and head weights [T, Hi] (float32) of a layer's normed inputs h [T, E] and
    normed query bottleneck h_q [T, Rq], the queries turned by position over their first rotary dims."""
    Dr, Hi = cfg.rotary_dims, cfg.index_heads
    q = jnp.einsum("tr,rhd->thd", h_q, lp.idx_wq)
    q = jnp.concatenate([apply_rope(q[..., :Dr], cos, sin), q[..., Dr:]], axis=-1)
    w = jnp.dot(h.astype(jnp.float32), lp.idx_w.astype(jnp.float32), preferred_element_type=jnp.float32)
    return q, w * Hi ** -0.5


def index_key(cfg: ModelConfig, lp: LayerParams, h: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """The indexer's keys [T, Di] of a layer's normed inputs h [T, E], turned as its queries are."""
    Dr = cfg.rotary_dims
    k = layer_norm(h @ lp.idx_wk, lp.idx_k_norm, lp.idx_k_norm_b, INDEX_KEY_NORM_EPS)
    return jnp.concatenate([apply_rope(k[:, None, :Dr], cos, sin)[:, 0], k[:, Dr:]], axis=-1)


def sparse_mla_attention(q: jax.Array, index_q: jax.Array, index_w: jax.Array, pool: jax.Array, tables: jax.Array,
                         seq_lens: jax.Array, query_start_loc: jax.Array, *, key_dim: int, value_dim: int, topk: int,
                         sm_scale: float, kv_dtype: Any = None, backend: str = "xla", layout=None) -> jax.Array:
    """Each token's attention over the `topk` keys its indexer scores best (`choose_keys`, then `attend_keys`).

    q: [T, Hq, key_dim] (the latent-space queries and rotary ones); index_q: [T, Hi, Di]; index_w: [T, Hi] float32;
    pool: [N, page_size, W] or [N, page_size, Hkv, W] with W = key_dim + Di (an MLA model's entries: the first
    `value_dim` dims the values, the last Di the indexer's keys), its pages of raw bits read as `kv_dtype` (see
    `attention.kv_storage_bits`); tables: [S, P] (this layer's pages); seq_lens, query_start_loc as
    `attention.paged_attention`'s; `backend`: the attention backend (the Pallas ones score keys in the indexer kernel
    and attend on the sparse latent kernel, each device its own KV heads where `layout` splits them). Returns
    [T, Hq, value_dim] in q's dtype (zero for padding tokens)."""
    kw = dict(kv_dtype=kv_dtype, backend=backend, layout=layout)
    slots, lens = choose_keys(index_q, index_w, pool, tables, seq_lens, query_start_loc, key_dim=key_dim, topk=topk,
                              **kw)
    return attend_keys(q, pool, slots, lens, key_dim=key_dim, value_dim=value_dim, sm_scale=sm_scale, **kw)


def choose_keys(index_q: jax.Array, index_w: jax.Array, pool: jax.Array, tables: jax.Array, seq_lens: jax.Array,
                query_start_loc: jax.Array, *, key_dim: int, topk: int, kv_dtype: Any = None, backend: str = "xla",
                layout=None) -> tuple[jax.Array, jax.Array]:
    """The keys each token attends, as `chosen_keys` gives them (slots [Hkv, T, topk], counts [T]): on the xla backend
    its running top-k, on the Pallas ones the indexer kernel's scores (`scored_keys`), each device over its own copy
    of the pool. Arguments as `sparse_mla_attention`'s."""
    if backend == "xla":
        return chosen_keys(index_q, index_w, pool, tables, seq_lens, query_start_loc, key_dim=key_dim, topk=topk,
                           kv_dtype=kv_dtype)
    interpret = backend.endswith("_interpret")

    def kernel(_, pool, index_q, index_w, tables, seq_lens, query_start_loc):
        return scored_keys(index_q, index_w, pool, tables, seq_lens, query_start_loc, key_dim=key_dim, topk=topk,
                           interpret=interpret)

    return on_head_shards(layout, kernel, None, (pool,), (index_q, index_w, tables, seq_lens, query_start_loc),
                          out_heads=(0, None))


def attend_keys(q: jax.Array, pool: jax.Array, slots: jax.Array, lens: jax.Array, *, key_dim: int, value_dim: int,
                sm_scale: float, kv_dtype: Any = None, backend: str = "xla", layout=None) -> jax.Array:
    """Each token's attention over its chosen keys (`choose_keys`' slots and counts); the rest as
    `sparse_mla_attention`'s."""
    if backend == "xla":
        return attend_chosen(q, pool, slots, lens, value_dim=value_dim, sm_scale=sm_scale, kv_dtype=kv_dtype)
    from pallas_kernels.sparse_latent_attention import sparse_latent_attention

    def kernel(q, pool, lens, slots):  # (each device: its own KV heads)
        return sparse_latent_attention(q, pool, slots, lens, key_dim=key_dim, value_dim=value_dim, sm_scale=sm_scale,
                                       interpret=backend.endswith("_interpret"))

    return on_head_shards(layout, kernel, q, (pool,), (lens,), (slots,))


def scored_keys(index_q: jax.Array, index_w: jax.Array, pool: jax.Array, tables: jax.Array, seq_lens: jax.Array,
                query_start_loc: jax.Array, *, key_dim: int, topk: int, interpret: bool = False
                ) -> tuple[jax.Array, jax.Array]:
    """`chosen_keys` on the Pallas backends: every key a token sees scored by the indexer kernel
    (`pallas_kernels.sparse_index`), the best `topk` of each row taken at once (`lax.top_k`); `SCORE_BYTES` of scores
    at most, so long contexts take the tokens in rows. The pool's pages in their own dtype (no bits)."""
    from pallas_kernels.sparse_index import index_scores, score_capacity

    T = index_q.shape[0]
    page_size, Hkv = pool.shape[1], pool.shape[2] if pool.ndim == 4 else 1
    Di = index_q.shape[-1]
    L = score_capacity(tables, page_size)
    K = min(topk, L)
    seq, pos, _, valid = token_rows(seq_lens, query_start_loc, T)

    def choose(iq, iw, seq, pos):  # a row of tokens: its slots [R, topk]
        s = index_scores(iq, iw, pool, tables, seq, pos, key_offset=key_dim, scale=Di ** -0.5, interpret=interpret)
        top, chosen = jax.lax.top_k(s, K)
        chosen = jnp.where(top > -jnp.inf, chosen, 0)  # (past the count: position 0's entry, never read)
        pages = jnp.take_along_axis(tables[seq], chosen // page_size, axis=-1)
        return jnp.pad(pages * page_size + chosen % page_size, ((0, 0), (0, topk - K)))

    R = max(1, min(T, SCORE_BYTES // (4 * L)))
    if R == T:
        slots = choose(index_q, index_w, seq, pos)
    else:
        n = -(-T // R)
        rows = lambda x, fill=0: jnp.pad(x, ((0, n * R - T),) + ((0, 0),) * (x.ndim - 1),  # noqa: E731
                                         constant_values=fill).reshape(n, R, *x.shape[1:])
        slots = jax.lax.map(lambda a: choose(*a), (rows(index_q), rows(index_w), rows(seq), rows(pos, -1)))
        slots = slots.reshape(n * R, topk)[:T]
    lens = jnp.where(valid, jnp.minimum(pos + 1, topk), 0).astype(jnp.int32)
    return jnp.broadcast_to(slots[None], (Hkv, T, topk)), lens


def chosen_keys(index_q: jax.Array, index_w: jax.Array, pool: jax.Array, tables: jax.Array, seq_lens: jax.Array,
                query_start_loc: jax.Array, *, key_dim: int, topk: int, kv_dtype: Any = None
                ) -> tuple[jax.Array, jax.Array]:
    """The keys each token attends, as `sparse_latent_attention` takes them: slots [Hkv, T, topk] int32 (flat entries
    of the pool, page * page_size + offset, best first; one row per KV head's copy of the pool) and their count per
    token [T] int32 (all it sees, at most `topk`; 0 for padding). Arguments as `sparse_mla_attention`'s."""
    T = index_q.shape[0]
    page_size, W = pool.shape[1], pool.shape[-1]
    Hkv = pool.shape[2] if pool.ndim == 4 else 1
    Di = W - key_dim
    tables, B = pad_to_blocks(tables, max(1, BLOCK_KEYS // page_size))
    J = B * page_size
    seq, pos, _, valid = token_rows(seq_lens, query_start_loc, T)
    pad = lambda x: jnp.pad(x, ((0, ROWS),) + ((0, 0),) * (x.ndim - 1))  # noqa: E731 (rows past T: padding)
    iq, iw, seq = pad(index_q.astype(jnp.float32)), pad(index_w), pad(seq)
    pos = jnp.pad(pos, (0, ROWS), constant_values=-1)
    order = _order(valid)

    def rows(c, slots):
        idx = jax.lax.dynamic_slice_in_dim(order, c * ROWS, ROWS)
        r_pos, r_tables, r_q, r_w = pos[idx], tables[seq[idx]], iq[idx], iw[idx]

        def block(j, best):  # fold in keys [j * J, (j + 1) * J): the running best (scores, positions) [R, Hkv, K]
            pages = jax.lax.dynamic_slice_in_dim(r_tables, j * B, B, axis=1)
            keys = read_pages(pool, pages, kv_dtype).reshape(ROWS, J, Hkv, W)[..., key_dim:]
            s = jax.nn.relu(jnp.einsum("rhd,rjkd->rkhj", r_q, keys) * Di ** -0.5)
            kpos = j * J + jnp.arange(J, dtype=jnp.int32)
            s = jnp.where((kpos[None, :] <= r_pos[:, None])[:, None], jnp.einsum("rh,rkhj->rkj", r_w, s), -jnp.inf)
            scores = jnp.concatenate([best[0], s], axis=-1)
            positions = jnp.concatenate([best[1], jnp.broadcast_to(kpos, s.shape)], axis=-1)
            top, i = jax.lax.top_k(scores, topk)
            return top, jnp.take_along_axis(positions, i, axis=-1)

        init = (jnp.full((ROWS, Hkv, topk), -jnp.inf, jnp.float32), jnp.zeros((ROWS, Hkv, topk), jnp.int32))
        scores, chosen = jax.lax.fori_loop(0, (jnp.max(r_pos) + J) // J, block, init)
        chosen = jnp.where(scores > -jnp.inf, chosen, 0)  # (past the count: position 0's entry, never read)
        pages = jnp.take_along_axis(r_tables[:, None, :], chosen // page_size, axis=-1)
        return slots.at[idx].set(pages * page_size + chosen % page_size)  # [R, Hkv, K]

    slots = jax.lax.fori_loop(0, _row_blocks(valid), rows, jnp.zeros((T + ROWS, Hkv, topk), jnp.int32))
    lens = jnp.where(valid, jnp.minimum(pos[:T] + 1, topk), 0).astype(jnp.int32)
    return slots[:T].transpose(1, 0, 2), lens


def _order(valid: jax.Array) -> jax.Array:
    """The real tokens first, then the padding ones, then `ROWS` indices past the end (rows of `ROWS`)."""
    return jnp.pad(jnp.argsort(~valid, stable=True).astype(jnp.int32), (0, ROWS), constant_values=valid.shape[0])


def _row_blocks(valid: jax.Array) -> jax.Array:
    return (jnp.sum(valid) + ROWS - 1) // ROWS


def attend_chosen(q: jax.Array, pool: jax.Array, slots: jax.Array, lens: jax.Array, *, value_dim: int,
                  sm_scale: float, kv_dtype: Any) -> jax.Array:
    """The xla backend's attention over the chosen entries (`chosen_keys`), `ROWS` tokens at a time."""
    T, Hq, key_dim = q.shape
    Hkv, W = slots.shape[0], pool.shape[-1]
    flat = pool.reshape(-1, W)  # an entry a row (of each KV head's copy, head-minor)
    valid = lens > 0
    pad = lambda x: jnp.pad(x, ((0, ROWS),) + ((0, 0),) * (x.ndim - 1))  # noqa: E731 (rows past T: padding)
    qf = pad(q.astype(jnp.float32) * sm_scale).reshape(T + ROWS, Hkv, Hq // Hkv, key_dim)
    slots, lens = pad(slots.transpose(1, 0, 2)), pad(lens)  # [T + ROWS, Hkv, K], [T + ROWS]
    order = _order(valid)

    def rows(c, out):
        idx = jax.lax.dynamic_slice_in_dim(order, c * ROWS, ROWS)
        seen = jnp.arange(slots.shape[-1], dtype=jnp.int32)[None, :] < lens[idx][:, None]  # [R, K]
        entries = read_pages(flat, slots[idx] * Hkv + jnp.arange(Hkv, dtype=jnp.int32)[None, :, None], kv_dtype)
        s = jnp.einsum("rkgd,rkjd->rkgj", qf[idx], entries[..., :key_dim])
        s = jnp.where(seen[:, None, None, :], s, -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)
        p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
        denom = p.sum(axis=-1, keepdims=True)
        o = jnp.einsum("rkgj,rkjv->rkgv", p / jnp.where(denom > 0, denom, 1.0), entries[..., :value_dim])
        return out.at[idx].set(o.reshape(ROWS, Hq, value_dim))

    out = jax.lax.fori_loop(0, _row_blocks(valid), rows, jnp.zeros((T + ROWS, Hq, value_dim)))
    return out[:T].astype(q.dtype)
