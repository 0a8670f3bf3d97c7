"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5; `config_mla.DSA_FAMILIES`): a lightning indexer scores every key
a token can see, and the token's latent attention (`models.mla`) reads only the `index_topk` best.

The indexer has `index_heads` query heads (from the queries' bottleneck) and one key per token (LayerNormed), both
turned by position over their first `rotary_dims` dims; the key rides in the token's page entry after the latent and
the rotary key, so prefix caching, preemption and KV transfer carry it as they carry the rest. Key j's score for a
query: sum over heads h of w_h * relu(q_h . k_j / sqrt(Di)), w the query token's head weights over sqrt(heads), in
float32. A token that sees at most `index_topk` keys attends all of them (the dense MLA); past that, the best ones.

On every attention backend the sparse attention runs here, in plain JAX (a sparse latent kernel is not written yet):
rows of tokens walk their sequences' pages in blocks, keeping each row's running best `index_topk` (score, position),
then gather those entries and attend them as the MLA attends its pages (their latent part the values).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.models.attention import pad_to_blocks, read_pages, token_rows
from jaxserve.models.ops import apply_rope, layer_norm
from jaxserve.models.params import LayerParams

INDEX_KEY_NORM_EPS = 1e-6  # the indexer key's LayerNorm (transformers': fixed)
ROWS = 8  # query tokens per loop iteration
BLOCK_KEYS = 256  # keys scored per block (whole pages, at least one)


def indexer(cfg: ModelConfig, lp: LayerParams, h: jax.Array, h_q: jax.Array, cos: jax.Array, sin: jax.Array
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The indexer's queries [T, Hi, Di] and head weights [T, Hi] (float32) of a layer's normed inputs h [T, E] and
    normed query bottleneck h_q [T, Rq]; and its keys [T, Di], each turned by position over its first rotary dims."""
    Dr, Hi = cfg.rotary_dims, cfg.index_heads
    q = jnp.einsum("tr,rhd->thd", h_q, lp.idx_wq)
    q = jnp.concatenate([apply_rope(q[..., :Dr], cos, sin), q[..., Dr:]], axis=-1)
    k = layer_norm(h @ lp.idx_wk, lp.idx_k_norm, lp.idx_k_norm_b, INDEX_KEY_NORM_EPS)
    k = jnp.concatenate([apply_rope(k[:, None, :Dr], cos, sin)[:, 0], k[:, Dr:]], axis=-1)
    w = jnp.dot(h.astype(jnp.float32), lp.idx_w.astype(jnp.float32), preferred_element_type=jnp.float32)
    return q, w * Hi ** -0.5, k


def sparse_mla_attention(q: jax.Array, index_q: jax.Array, index_w: jax.Array, pool: jax.Array, tables: jax.Array,
                         seq_lens: jax.Array, query_start_loc: jax.Array, *, key_dim: int, value_dim: int, topk: int,
                         sm_scale: float, kv_dtype: Any = None) -> jax.Array:
    """Each token's attention over the `topk` keys its indexer scores best.

    q: [T, Hq, key_dim] (the latent-space queries and rotary ones); index_q: [T, Hi, Di]; index_w: [T, Hi] float32;
    pool: [N, page_size, W] or [N, page_size, Hkv, W] with W = key_dim + Di (an MLA model's entries: the first
    `value_dim` dims the values, the last Di the indexer's keys), its pages of raw bits read as `kv_dtype` (see
    `attention.kv_storage_bits`); tables: [S, P] (this layer's pages); seq_lens, query_start_loc as
    `attention.paged_attention`'s. Returns [T, Hq, value_dim] in q's dtype (zero for padding tokens)."""
    T, Hq, _ = q.shape
    page_size, W = pool.shape[1], pool.shape[-1]
    Hkv = pool.shape[2] if pool.ndim == 4 else 1
    Di = W - key_dim
    tables, B = pad_to_blocks(tables, max(1, BLOCK_KEYS // page_size))
    J = B * page_size
    seq, pos, _, valid = token_rows(seq_lens, query_start_loc, T)
    pad = lambda x: jnp.pad(x, ((0, ROWS),) + ((0, 0),) * (x.ndim - 1))  # noqa: E731 (rows past T: padding)
    qf = pad(q.astype(jnp.float32) * sm_scale).reshape(T + ROWS, Hkv, Hq // Hkv, key_dim)
    iq, iw = pad(index_q.astype(jnp.float32)), pad(index_w)
    seq, pos = pad(seq), jnp.pad(pos, (0, ROWS), constant_values=-1)
    order = jnp.pad(jnp.argsort(~valid, stable=True).astype(jnp.int32), (0, ROWS), constant_values=T)
    flat = pool.reshape(-1, W)  # an entry a row (of each KV head's copy, head-minor)

    def rows(c, out):
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
        seen = scores > -jnp.inf
        chosen = jnp.where(seen, chosen, 0)
        pages = jnp.take_along_axis(r_tables[:, None, :], chosen // page_size, axis=-1)
        slots = pages * page_size + chosen % page_size  # [R, Hkv, K]
        entries = read_pages(flat, slots * Hkv + jnp.arange(Hkv, dtype=jnp.int32)[None, :, None], kv_dtype)
        s = jnp.einsum("rkgd,rkjd->rkgj", qf[idx], entries[..., :key_dim])
        s = jnp.where(seen[:, :, None, :], s, -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)
        p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
        denom = p.sum(axis=-1, keepdims=True)
        o = jnp.einsum("rkgj,rkjv->rkgv", p / jnp.where(denom > 0, denom, 1.0), entries[..., :value_dim])
        return out.at[idx].set(o.reshape(ROWS, Hq, value_dim))

    out = jax.lax.fori_loop(0, (jnp.sum(valid) + ROWS - 1) // ROWS, rows, jnp.zeros((T + ROWS, Hq, value_dim)))
    return out[:T].astype(q.dtype)
