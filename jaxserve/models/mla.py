"""Multi-head latent attention (DeepSeek-V2 / -V3; `jaxserve.config_mla`) over the paged KV cache.

Each token writes one page entry per layer: its normed latent (`kv_lora_rank` dims) and its rotated key
(`rotary_dims`), shared by every head. Nothing is expanded per head: a query's unrotated dims are carried into
the latent's space through the keys' up-projection (`w_uk`, absorbed), so every head attends over the same entries
as multi-query attention with keys of R + Dr dims, and the values are the entries themselves. The attention's
output (in latent space: its first R dims; the rotary ones are dropped) goes through the values' up-projection
(`w_uv`) per head. The scores are those of transformers' expanded form exactly: q_nope · (W_uk c) = (W_ukᵀ q_nope) · c.

On the `xla` backend the attention is the paged attention with the entries as keys and values; on the Pallas
backends it is the latent attention kernel (`pallas_kernels.latent_attention`: the entries read once, as keys and
as values; the Triton lowering on a GPU under the Mosaic GPU backends too, which have no latent form). With
DeepSeek Sparse Attention (`cfg.index_topk`) each entry also holds the indexer's key, and each token attends only
the keys its indexer picks (`models.sparse_mla`; on the Pallas backends the indexer's scores and the attention in
kernels).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.config_mla import LATENT_NORM_EPS
from jaxserve.models.attention import AttentionBackend, paged_attention
from jaxserve.models.head_shards import on_head_shards
from jaxserve.models.inputs import ModelInputs
from jaxserve.models.kv_pages import write_kv
from jaxserve.models.lora import latent_lora, lora_deltas
from jaxserve.models.ops import apply_rope, rms_norm
from jaxserve.models.params import LayerParams, ParamInfo
from jaxserve.models.quantized import project
from jaxserve.models.rotary import query_scale
from jaxserve.models.sparse_mla import attend_keys, choose_keys, index_key, index_queries


def mla_attention(cfg: ModelConfig, backend: AttentionBackend, inputs: ModelInputs, cos: jax.Array, sin: jax.Array,
                  lp: LayerParams, h: jax.Array, k_all: jax.Array, v_all: jax.Array, layer: jax.Array,
                  kv_dtype: Any, layout=None, lora: Any = None, shared: list | tuple = ()) -> tuple:
    """The attention block's output [T, Hq * Dv] of normed inputs h [T, E] (before the output projection), and the
    page pools with this step's entries written (`k_all`: [L * N, page_size, R + Dr], or with an axis of KV heads
    under tensor parallelism; `v_all`: the empty values pool, as it came); `layout`: as `paged_attention`'s; `lora`:
    the layer's adapter slots (`models.lora.LATENT`), by `inputs.lora_slots`.

    `shared`, in a model whose layers may reuse the last full layer's choice of keys (`index_shared_layers`: GLM-5.2's
    IndexShare), is [(slots, counts)]: that choice (`sparse_mla.choose_keys`' form, its slots less their layer's
    offset into the pool), returned after the pools as this layer leaves it (its own where it chooses)."""
    T, D, Dr, R = h.shape[0], cfg.head_dim, cfg.rotary_dims, cfg.kv_lora_rank
    num_pages, page_size = k_all.shape[0] // cfg.num_layers, k_all.shape[1]
    hkv = 1 if k_all.ndim == 3 else k_all.shape[2]  # (`forward` drops the axis of one head: see there)
    heads = functools.partial(jnp.einsum, "te,ehd->thd")
    ls = inputs.lora_slots
    dq, dkv = (None, None) if lora is None else lora_deltas(h, lora.a_qkv, [lora.b_q, lora.b_kva], ls)
    if lp.wq_a is not None:  # the queries' bottleneck, normed
        q_a = project(h, lp.wq_a)
        h_q = rms_norm(q_a if dq is None else q_a + dq, lp.q_a_norm, LATENT_NORM_EPS)
        dq = None if lora is None else lora_deltas(h_q, lora.a_qb, [lora.b_qb], ls)[0]
    else:
        h_q = h
    q = project(h_q, lp.wq, heads)  # [T, Hq, D]: unrotated dims, then rotary ones
    q = q if dq is None else q + dq.reshape(q.shape)
    kv = project(h, lp.wkv_a)  # [T, R + Dr]
    kv = kv if dkv is None else kv + dkv
    latent = rms_norm(kv[:, :R], lp.kv_a_norm, LATENT_NORM_EPS)
    k_rot = apply_rope(kv[:, None, R:], cos, sin)  # [T, 1, Dr]
    q_rot = apply_rope(q[..., D - Dr:], cos, sin)  # [T, Hq, Dr]
    q_latent = jnp.einsum("thn,hnr->thr", q[..., : D - Dr], lp.w_uk, preferred_element_type=jnp.float32)
    if lora is not None:  # kv_b_proj's keys' delta, absorbed as its weights are
        q_latent = q_latent + latent_lora(q[..., : D - Dr], lora.a_kvb, lora.b_kvb, ls, D - Dr)
    q = jnp.concatenate([q_latent.astype(q.dtype), q_rot], axis=-1)  # [T, Hq, R + Dr]
    if cfg.query_scale_beta:  # (Mistral 4's)
        q = q * query_scale(cfg, inputs.positions).astype(q.dtype)[:, None, None]
    parts = [latent[:, None, :], k_rot.astype(latent.dtype)]
    if cfg.index_topk:  # (DeepSeek Sparse Attention: the indexer's key rides in the entry)
        parts.append(index_key(cfg, lp, h, cos, sin)[:, None, :].astype(latent.dtype))
    # One entry per token, copied to each KV head a tensor-parallel mesh gives a device (`sharding.plan`).
    entry = jnp.concatenate(parts, axis=-1)
    entry = jnp.broadcast_to(entry, (T, hkv, entry.shape[-1]))
    slots = inputs.slot_mapping + layer * (num_pages * page_size)
    k_all, v_all = write_kv(k_all, v_all, entry, jnp.zeros((T, hkv, 0), entry.dtype), slots, kv_dtype)
    tables = inputs.block_tables + layer * num_pages
    if cfg.index_topk:
        if inputs.last_key is not None:
            raise ValueError("DeepSeek Sparse Attention has no spans attended both ways (last_key)")
        kw = dict(kv_dtype=kv_dtype, backend=backend, layout=layout)
        choose = lambda: choose_keys(*index_queries(cfg, lp, h, h_q, cos, sin), k_all, tables,  # noqa: E731
                                     inputs.seq_lens, inputs.query_start_loc, key_dim=R + Dr, topk=cfg.index_topk,
                                     **kw)
        # A layer sharing the last full layer's choice projects no indexer queries (its key, zeros, is still
        # written: every layer's entries are one width). The slots carried as the pages of layer 0 hold them.
        if shared:
            offset = layer * (num_pages * page_size)
            full = jnp.asarray([i not in cfg.index_shared_layers for i in range(cfg.num_layers)])[layer]
            slots, lens = jax.lax.cond(full, choose, lambda: (shared[0][0] + offset, shared[0][1]))
            shared = [(slots - offset, lens)]
        else:
            slots, lens = choose()
        out = attend_keys(q, k_all, slots, lens, key_dim=R + Dr, value_dim=R, sm_scale=cfg.sm_scale, **kw)
    elif backend == "xla":
        out = paged_attention(
            "xla", q, k_all, None, tables, inputs.seq_lens, inputs.query_start_loc, sm_scale=cfg.sm_scale,
            decode=inputs.decode, kv_dtype=kv_dtype, last_key=inputs.last_key,
        )[..., :R]  # the entries' latent part is the values
    else:
        from pallas_kernels.latent_attention import latent_paged_attention

        if inputs.last_key is not None:
            raise ValueError("the latent attention kernel has no spans attended both ways (last_key)")
        kernel = functools.partial(latent_paged_attention, value_dim=R, sm_scale=cfg.sm_scale,
                                   interpret=backend.endswith("_interpret"))
        out = on_head_shards(layout, kernel, q, (k_all,), (tables, inputs.seq_lens, inputs.query_start_loc))
    values = jnp.einsum("thr,hrv->thv", out, lp.w_uv, preferred_element_type=jnp.float32)
    if lora is not None:  # and its values'
        values = values + latent_lora(out.astype(h.dtype), lora.a_kvb, lora.b_kvb, ls, D - Dr, value=True)
    return values.astype(h.dtype).reshape(T, -1), k_all, v_all, *shared


def declare_mla(cfg: ModelConfig, L: int) -> LayerParams:
    """`L` stacked layers' attention of an MLA model (`config_mla`) and their norms (the MLP declared after)."""
    E, Hq, D, Dr, R, Rq = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.rotary_dims, cfg.kv_lora_rank, cfg.q_lora_rank
    Hi, Di = cfg.index_heads, cfg.index_head_dim
    dsa = bool(cfg.index_topk)
    return LayerParams(
        attn_norm=ParamInfo((L, E), ("layers", "embed"), "ones"),
        wq=ParamInfo((L, Rq or E, Hq, D), ("layers", "latent" if Rq else "embed", "q_heads", "head_dim")),
        wk=None, wv=None,
        wo=ParamInfo((L, Hq, cfg.v_head_dim, E), ("layers", "q_heads", "head_dim", "embed")),
        mlp_norm=ParamInfo((L, E), ("layers", "embed"), "ones"),
        wq_a=ParamInfo((L, E, Rq), ("layers", "embed", "latent")) if Rq else None,
        q_a_norm=ParamInfo((L, Rq), ("layers", "latent"), "ones") if Rq else None,
        wkv_a=ParamInfo((L, E, R + Dr), ("layers", "embed", "latent")),
        kv_a_norm=ParamInfo((L, R), ("layers", "latent"), "ones"),
        w_uk=ParamInfo((L, Hq, D - Dr, R), ("layers", "q_heads", "head_dim", "latent")),
        w_uv=ParamInfo((L, Hq, R, cfg.v_head_dim), ("layers", "q_heads", "latent", "head_dim")),
        # The indexer: every device holds it whole (its heads are summed into one score a key).
        idx_wq=ParamInfo((L, Rq, Hi, Di), ("layers", "latent", None, "head_dim")) if dsa else None,
        idx_wk=ParamInfo((L, E, Di), ("layers", "embed", "head_dim")) if dsa else None,
        idx_k_norm=ParamInfo((L, Di), ("layers", "head_dim"), "ones") if dsa else None,
        idx_k_norm_b=ParamInfo((L, Di), ("layers", "head_dim"), "zeros") if dsa else None,
        idx_w=ParamInfo((L, E, Hi), ("layers", "embed", None), dtype=jnp.float32) if dsa else None,
    )
