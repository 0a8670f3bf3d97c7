"""The Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2, Qwen3, their MoE forms, Gemma 2 and 3, GLM, gpt-oss;
DeepSeek's latent attention in `mla`) as pure functions."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jaxserve.config import GEMMA_FAMILIES, ModelConfig
from jaxserve.models.attention import AttentionBackend, paged_attention
from jaxserve.models.gemma4 import (
    add_per_layer_input,
    experts_beside,
    fill_rows,
    full_pool_view,
    kind_lora,
    per_layer_inputs,
    shared_kv,
    value_norm,
)
from jaxserve.models.inputs import KVCache, ModelInputs
from jaxserve.models.kept_layers import KeptLayers
from jaxserve.models.kv_pages import kv_storage_bits, write_kv
from jaxserve.models.lora import lora_deltas
from jaxserve.models.mamba import NO_MIXER, Beside, hybrid_layers
from jaxserve.models.mla import mla_attention
from jaxserve.models.moe import moe_mlp
from jaxserve.models.ops import apply_rope, clip_qkv, mlp_activation, mlp_input, model_norm, qk_norm, rms_norm
from jaxserve.models.params import LayerParams, Params
from jaxserve.models.quantized import project
from jaxserve.models.rotary import query_scale, rope_tables
from pallas_kernels.ragged_attention_args import FP8_KV_DTYPES

_SWAP_ROWS = (2, 64)  # measured: no gain at 1 row (a matrix-vector product) nor from 128 rows


def _dot_out_major(x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """x [T, K] times an out-major weight w [N, K]: [T, N] (accumulated and returned in `out_dtype`
    if given).

    On the CPU, for 2 to 64 rows, as (w · xᵀ)ᵀ: XLA:CPU's matmul of a few rows against a wide weight
    runs 1.3-2.4x faster with the operands swapped (SmolLM2's LM head at 4 rows: 23 -> 10 ms, its
    gate/up projection at 16 rows: 2.8 -> 1.4 ms). The barrier keeps XLA from folding the transpose
    back into the matmul."""
    dims = (((1,), (1,)), ((), ()))
    if _SWAP_ROWS[0] <= x.shape[0] <= _SWAP_ROWS[1] and jax.default_backend() == "cpu":
        return jax.lax.optimization_barrier(jax.lax.dot_general(w, x, dims, preferred_element_type=out_dtype)).T
    return jax.lax.dot_general(x, w, dims, preferred_element_type=out_dtype)


def _layer(
    cfg: ModelConfig,
    backend: AttentionBackend,
    inputs: ModelInputs,
    cos: jax.Array,
    sin: jax.Array,
    carry: tuple[jax.Array, jax.Array, jax.Array],
    xs: tuple[LayerParams, jax.Array],
    layout=None,
    kv_dtype=None,
    local: bool = False,
    rope: bool = True,
    attn_in: jax.Array | None = None,
    mixer=None,
):
    """One decoder layer; `local` (static): a sliding-window layer of a model whose layers differ; `attn_in`: what
    its attention projects in place of its normed input (an EAGLE-3 draft's first layer: `models.eagle`); `mixer`:
    a hybrid model's Mamba layer (`mamba.hybrid_layers`), in attention's place, its states in the pages', or
    `NO_MIXER` (an MLP alone); a layer with no MLP weights (a hybrid model's mixer alone) ends after its mixer."""
    # x: [T, E]; k_all, v_all: [L * N, page_size, Hkv, D] (`ModelConfig.kv_cache_dims`); `shared`: the keys chosen
    # for layers that reuse them (`mla.mla_attention`), in a model with such layers
    x, k_all, v_all, *shared = carry
    lp, layer = xs
    cfg = cfg.kind_config(local)  # (Gemma 4's full-attention layers attend with their own head width and rotary)
    lora = lp.lora if inputs.lora_slots is not None else None  # adapter slots, in a LoRA engine's step
    if lora is not None and cfg.gemma4 is not None:  # (Gemma 4's held at the widest kind's widths)
        lora = kind_lora(cfg, lora)

    xn = x.astype(lp.attn_norm.dtype) if cfg.mamba is not None and cfg.mamba.residual_fp32 else x  # (float32: Mamba's)
    h_attn = x if lp.attn_norm is None or mixer is NO_MIXER else model_norm(cfg, xn, lp.attn_norm, lp.attn_norm_b)
    x_in = x  # (GPT-NeoX's MLP norms the layer's input, beside attention)
    if mixer is not NO_MIXER:  # (a hybrid model's layer of an MLP alone has none)
        with jax.named_scope("attention"):
            h = h_attn if attn_in is None else attn_in
            if mixer is not None and not isinstance(mixer, Beside):
                out, k_all, v_all = mixer(h, k_all, v_all)
            else:
                args = (cfg, backend, inputs, cos, sin, lp, h, k_all, v_all, layer, kv_dtype)
                if cfg.kv_lora_rank:
                    attn, k_all, v_all, *shared = mla_attention(*args, layout=layout, lora=lora, shared=shared)
                else:
                    attn, k_all, v_all = _attention(*args, local=local, rope=rope, layout=layout, lora=lora)
                # As one [T, Hq*D] x [Hq*D, E] matmul: the einsum form made XLA:CPU transpose wo every step.
                if lp.wo_t is not None:
                    out = project(attn, lp.wo_t, _dot_out_major)
                else:
                    out = project(attn, lp.wo, lambda a, w: a @ w.reshape(-1, w.shape[-1]))
                if lora is not None:
                    out = out + lora_deltas(attn, lora.a_o, [lora.b_o], inputs.lora_slots)[0]
            out = out if lp.bo is None else out + lp.bo
            if isinstance(mixer, Beside):
                out = out + mixer.run(h)
            if lp.post_attn_norm is not None:
                out = model_norm(cfg, out, lp.post_attn_norm)
            x = x + _residual(cfg, out)

    if lp.w_up is None and lp.w_gate_up is None and lp.router is None:
        return (x, k_all, v_all, *shared), None
    if lp.router is not None and lp.w_up is None:
        with jax.named_scope("moe"):
            h = mlp_input(cfg, lp, x, x_in, h_attn)
            out = moe_mlp(h, lp, cfg, layout, None if lora is None else (lora, inputs.lora_slots), backend)
            if lp.post_mlp_norm is not None:
                out = model_norm(cfg, out, lp.post_mlp_norm)
            return (x + _residual(cfg, out), k_all, v_all, *shared), None

    with jax.named_scope("mlp"):
        h = mlp_input(cfg, lp, x, x_in, h_attn)
        if lp.w_gate_up is not None:
            gate, up = jnp.split(project(h, lp.w_gate_up, _dot_out_major), 2, axis=-1)  # [T, F] each
        else:
            gate = None if lp.w_gate is None else project(h, lp.w_gate)  # [T, F]; None: an ungated MLP
            up = project(h, lp.w_up)
        if lora is not None:
            dg, du = lora_deltas(h, lora.a_gate_up, [lora.b_gate, lora.b_up], inputs.lora_slots)
            gate, up = None if gate is None else gate + dg, up + du
        if lp.b_up is not None:
            gate, up = None if gate is None else gate + lp.b_gate, up + lp.b_up
        act = mlp_activation(cfg, gate, up, lp.xielu)
        down = project(act, lp.w_down_t, _dot_out_major) if lp.w_down_t is not None else project(act, lp.w_down)
        if lora is not None:
            down = down + lora_deltas(act, lora.a_down, [lora.b_down], inputs.lora_slots)[0]
        if lp.b_down is not None:
            down = down + lp.b_down
        if lp.router is not None:  # (Gemma 4's experts beside its MLP)
            down = experts_beside(cfg, lp, x, down, layout, backend)
        if lp.post_mlp_norm is not None:
            down = model_norm(cfg, down, lp.post_mlp_norm)
        x = x + _residual(cfg, down)
    if lp.ple_gate is not None:  # (Gemma 4 E2B/E4B's input of each layer)
        x = add_per_layer_input(cfg, lp, x, inputs.per_layer, layer)
    if lp.layer_scalar is not None:  # (Gemma 4's)
        x = x * lp.layer_scalar.astype(x.dtype)
    return (x, k_all, v_all, *shared), None


def _attention(cfg: ModelConfig, backend: AttentionBackend, inputs: ModelInputs, cos: jax.Array, sin: jax.Array,
               lp: LayerParams, h: jax.Array, k_all: jax.Array, v_all: jax.Array, layer: jax.Array, kv_dtype,
               local: bool, lora, layout=None, rope: bool = True) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Multi-head (grouped-query) attention of normed inputs h [T, E]: its output [T, Hq * D] before the output
    projection, and the page pools with this step's keys and values written."""
    num_pages = k_all.shape[0] // len(cfg.attention_layers)
    page_size = k_all.shape[1]
    if lp.wqkv is not None:
        T, Hq, Hkv, D, Q = h.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_heads * cfg.q_head_dim
        qkv = project(h, lp.wqkv, _dot_out_major)  # [T, Q + 2 * Hkv * D] (Q: the queries, and gates where gated)
        q = qkv[:, :Q].reshape(T, Hq, cfg.q_head_dim)
        k = qkv[:, Q: Q + Hkv * D].reshape(T, Hkv, D)
        v = qkv[:, Q + Hkv * D:].reshape(T, Hkv, D)
    else:
        heads = functools.partial(jnp.einsum, "te,ehd->thd")
        q = project(h, lp.wq, heads)  # [T, Hq, D]
        k = project(h, lp.wk, heads)  # [T, Hkv, D]
        v = k if lp.wv is None else project(h, lp.wv, heads)  # [T, Hkv, D] (Gemma 4's keys as values)
    if lora is not None:
        dq, dk, dv = lora_deltas(h, lora.a_qkv, [lora.b_q, lora.b_k, lora.b_v], inputs.lora_slots)
        q, k = q + dq.reshape(q.shape), k + dk.reshape(k.shape)
        v = k if lp.wv is None and lp.wqkv is None else v + dv.reshape(v.shape)  # (Gemma 4's keys as values)
    if lp.bq is not None:
        q, k, v = q + lp.bq, k + lp.bk, v + lp.bv
    q, k, v = clip_qkv(cfg, q, k, v, normed=False)  # (OLMo's: each clamped after its projection)
    gate = None
    if cfg.attn_gate_width:  # (each head's gate after its query: one per channel, or one for all)
        q, gate = q[..., :cfg.head_dim], q[..., cfg.head_dim:]
    if lp.q_norm is not None and not cfg.rope_qk_norm:
        q, k = qk_norm(cfg, q, lp.q_norm, lp.q_norm_b), qk_norm(cfg, k, lp.k_norm, lp.k_norm_b)
    q, k, v = clip_qkv(cfg, q, k, v, normed=True)  # (OLMoE's: after its norms)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    pool, copies = k_all.shape, 1
    if cfg.gemma4 is not None:  # values normed; a full-attention layer's pages viewed as its heads, each row filled
        v = value_norm(v, cfg)
        k_all, v_all = full_pool_view(k_all, cfg.head_dim), full_pool_view(v_all, cfg.head_dim)
        copies = k_all.shape[-2] // k.shape[1]
        k, v = fill_rows(k, v, copies)
    if cfg.rope_qk_norm and lp.q_norm is not None:  # (Hunyuan's: after the rotation)
        q, k = qk_norm(cfg, q, lp.q_norm), qk_norm(cfg, k, lp.k_norm)
    elif cfg.rope_qk_norm and rope:  # (Llama 4's: no weight, its rotated layers only)
        q, k = (rms_norm(x, jnp.ones((), x.dtype), cfg.rms_norm_eps) for x in (q, k))
    if cfg.query_scale_beta and (cfg.family != "llama4" or not rope):  # (Llama 4's: its unrotated layers only)
        q = q * query_scale(cfg, inputs.positions).astype(q.dtype)[:, None, None]

    # A float8 cache with scales holds K / k_scale and V / v_scale: attend with q * k_scale, times v_scale.
    scaled = lp.k_scale is not None and kv_dtype is not None and jnp.dtype(kv_dtype) in FP8_KV_DTYPES
    if scaled:
        ks, vs = lp.k_scale.astype(jnp.float32), lp.v_scale.astype(jnp.float32)
        k, v = k.astype(jnp.float32) / ks, v.astype(jnp.float32) / vs
        q = (q.astype(jnp.float32) * ks).astype(q.dtype)
    row, slots = layer, inputs.slot_mapping + layer * (num_pages * page_size)
    if cfg.gemma4 is not None and cfg.gemma4.shared_layers:  # (its last layers read an earlier layer's pages)
        row, slots = shared_kv(cfg, layer, local, inputs.slot_mapping, num_pages * page_size)
    k_all, v_all = write_kv(k_all, v_all, k, v, slots, kv_dtype)

    attn = paged_attention(
        backend, q, k_all, v_all,
        inputs.block_tables + row * num_pages, inputs.seq_lens, inputs.query_start_loc,
        sm_scale=cfg.sm_scale, soft_cap=cfg.attn_logit_softcap, decode=inputs.decode, kv_dtype=kv_dtype,
        sliding_window=cfg.sliding_window if cfg.layer_types is None or local else None,
        last_key=inputs.last_key if cfg.gemma4 is None or local else None,  # (Gemma 4's full layers: causal)
        chunk=cfg.attention_chunk if local else None,
        sinks=lp.sinks, layout=layout, kv_copies=copies,
        alibi=None if cfg.alibi_slopes is None else jnp.asarray(cfg.alibi_slopes, jnp.float32))  # [T, Hq, D]
    if scaled:
        attn = (attn.astype(jnp.float32) * vs).astype(attn.dtype)
    if gate is not None:
        attn = attn * jax.nn.sigmoid(gate).astype(attn.dtype)
    if cfg.attention_value_scale != 1.0:  # (MiMo-V2-Flash's values scaled: the output alike)
        attn = attn * jnp.asarray(cfg.attention_value_scale, attn.dtype)
    return attn.reshape(attn.shape[0], -1), k_all.reshape(pool), v_all.reshape(pool)


def _residual(cfg: ModelConfig, out: jax.Array) -> jax.Array:
    """A block's output as its residual add takes it: scaled by Granite's `residual_multiplier`."""
    return out if cfg.residual_multiplier == 1.0 else out * jnp.asarray(cfg.residual_multiplier, out.dtype)


# The unrolled loop's one traced layer (the layers' shapes alike): traced and lowered once, called L times (inlined).
_layer_once = jax.jit(_layer, static_argnums=(0, 1, 7, 8, 9, 10))


def lm_head(params: Params, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Logits [R, V] float32 of last hidden states x [R, E]: the final norm (none when `final_norm` is None: an EAGLE
    head's), then the vocabulary (and the model's soft-cap)."""
    x = x if params.final_norm is None else model_norm(cfg, x, params.final_norm, params.final_norm_b)
    x = x.astype(params.final_norm.dtype) if cfg.mamba is not None and cfg.mamba.residual_fp32 else x  # (Mamba's)
    if params.lm_head_t is not None:  # untied, stored out-major (see `unstack_layers`)
        logits = _dot_out_major(x, params.lm_head_t, jnp.float32)
    elif params.lm_head is None:
        logits = _dot_out_major(x, params.embed, jnp.float32)
    else:
        logits = jnp.einsum("re,ev->rv", x, params.lm_head, preferred_element_type=jnp.float32)
    if params.lm_head_b is not None:  # (Phi's)
        logits = logits + params.lm_head_b.astype(jnp.float32)
    if cfg.final_logit_softcap is not None:
        logits = cfg.final_logit_softcap * jnp.tanh(logits / cfg.final_logit_softcap)
    if cfg.logits_scaling != 1.0:  # Granite
        logits = logits / cfg.logits_scaling
    return logits


def _embed(params: Params, inputs: ModelInputs, cfg: ModelConfig) -> tuple[jax.Array, jax.Array | None]:
    """The tokens' embeddings [T, E] (an image's tokens take its own), and Qwen3-VL's deepstack embeddings of an
    image's tokens [T, deepstack layers, E] (None without)."""
    ids = inputs.token_ids if inputs.image_mask is None else jnp.where(inputs.image_mask, 0, inputs.token_ids)
    x = params.embed[ids]  # [T, E]; an image's tokens stand for it by a negative id (`engine.multimodal`)
    x = x * jnp.asarray(cfg.hidden_size**0.5, x.dtype) if cfg.family in GEMMA_FAMILIES else x
    deep = None
    if inputs.image_embeds is not None:  # an image's tokens take its embeddings (scaled as inputs are after)
        x = jnp.where(inputs.image_mask[:, None], inputs.image_embeds[:, :x.shape[1]].astype(x.dtype), x)
        if cfg.deepstack_layers:  # Qwen3-VL: then its deepstack embeddings, one [T, E] per early layer
            deep = inputs.image_embeds[:, x.shape[1]:].reshape(x.shape[0], cfg.deepstack_layers, x.shape[1])
    x = x * jnp.asarray(cfg.embedding_multiplier, x.dtype) if cfg.embedding_multiplier != 1.0 else x  # Granite
    if params.pos_embed is not None:  # GPT-2's learned positions (added to a prompt's given embeddings too, as HF)
        x = x + params.pos_embed[inputs.positions].astype(x.dtype)
    return x, deep


def forward(
    params: Params,
    kv: KVCache,
    inputs: ModelInputs,
    cfg: ModelConfig,
    backend: AttentionBackend = "xla",
    layout=None,
    return_hidden: bool = False,
    embeds: jax.Array | None = None,
    aux_layers: tuple[int, ...] = (),
    attn_inputs: jax.Array | None = None,
):
    """One model step over a ragged batch: logits at `inputs.logits_indices` ([R, V] float32) and the KV cache with
    this step's keys and values written into their pages; with `return_hidden` (static), also every token's last
    hidden state [T, E] (before the final norm, for `lm_head`). `embeds` [T, E]: the first layer's inputs in place of
    the tokens' embeddings (an MTP layer's, `models.mtp`; an EAGLE draft's, `models.eagle`). `aux_layers` (static,
    with `return_hidden`): also the states entering these layers, [T, len * E] (`kept_layers`). `attn_inputs` [T, E']:
    what the first layer's attention projects in place of its normed input (an EAGLE-3 draft's; unstacked only).
    `layout` (a `sharding.MeshLayout`, for a model sharded over a mesh): where the experts are, and the axis the
    attention kernels split heads over."""
    L, N, page_size, hkv, d = kv.k.shape
    with jax.named_scope("embed"):
        x, deep = (embeds, None) if embeds is not None else _embed(params, inputs, cfg)
        x = x if params.embed_norm is None else model_norm(cfg, x, params.embed_norm, params.embed_norm_b)  # (BLOOM's)
        x = x.astype(jnp.float32) if cfg.mamba is not None and cfg.mamba.residual_fp32 else x
        if params.ple_embed is not None:  # (Gemma 4 E2B/E4B's; an image's tokens look up the pad token's, 0)
            ids = inputs.token_ids if inputs.image_mask is None else jnp.where(inputs.image_mask, 0, inputs.token_ids)
            inputs = dataclasses.replace(inputs, per_layer=per_layer_inputs(params, cfg, ids, x))
    by_window = {False: rope_tables(cfg.kind_config(False), inputs.positions, long_prompt=inputs.long_prompt,
                                    offsets=inputs.rope_offsets)}  # (Gemma 4's full layers': their own)
    by_window[True] = rope_tables(cfg, inputs.positions, local=True) if cfg.rope_local_theta else by_window[False]
    # Each kind of layer's (cos, sin): a NoPE layer's leave its queries and keys as they are.
    tables = {(local, rope): by_window[local] if rope else (jnp.ones_like(by_window[local][0]),
                                                            jnp.zeros_like(by_window[local][1]))
              for local, rope in {cfg.layer_kind(i) for i in range(cfg.num_layers)}}
    # An MLA model's pages of one latent per token go without their axis of one head: XLA:CPU laid that axis out apart
    # and copied the whole pool into every layer's attention loop (a DeepSeek-V2-shaped model's decode step, 4 layers
    # over 38 MB of pages: 79.5 -> 29.5 ms; it still copies the pool in and out once a step).
    squeeze = cfg.kv_lora_rank and hkv == 1
    k_all = kv.k.reshape(L * N, page_size, d) if squeeze else kv.k.reshape(L * N, page_size, hkv, d)
    v_all = kv.v.reshape(L * N, page_size, hkv, kv.v.shape[-1])  # (an MLA model's: 0 wide)
    # The CPU attention reads and writes narrow pages as their bits, the kernels as floats. A pool kept in
    # the other form is converted here, which copies it (the engine allocates each backend's own form).
    kv_dtype, bits = kv.dtype, kv_storage_bits(kv.dtype)
    want = bits if backend == "xla" and bits is not None else kv_dtype
    if k_all.dtype != want:
        k_all, v_all = jax.lax.bitcast_convert_type(k_all, want), jax.lax.bitcast_convert_type(v_all, want)

    def deepstack(carry, layer):
        """After layer `layer` of the first `cfg.deepstack_layers`, its deepstack embeddings added to the image's
        tokens' hidden states."""
        if deep is None:
            return carry
        x, *rest = carry
        i = jnp.minimum(layer, cfg.deepstack_layers - 1)
        add = (layer < cfg.deepstack_layers) & inputs.image_mask
        return (x + jnp.where(add[:, None], jax.lax.dynamic_index_in_dim(deep, i, 1, False).astype(x.dtype), 0), *rest)

    kept = KeptLayers(aux_layers, cfg.num_layers)  # the states entering `aux_layers`, carried beside (x, k, v)

    # A model whose layers may reuse an earlier layer's choice of keys carries it (`mla.mla_attention`'s `shared`).
    shared = ((jnp.zeros((hkv, x.shape[0], cfg.index_topk), jnp.int32), jnp.zeros(x.shape[:1], jnp.int32)),
              ) if cfg.index_shared_layers else ()
    n = 3 + len(shared)

    def run(layer_fn, carry, layer):  # one layer over (x, k, v[, shared][, kept])
        carry = kept.keep(carry, layer)
        out, _ = layer_fn(carry[:n])
        return deepstack(out, layer) + carry[n:]

    def step(carry, xs):  # every layer alike
        return run(lambda c: _layer(cfg, backend, inputs, *tables[cfg.layer_kind(0)], c, xs, layout, kv_dtype,
                                    *cfg.layer_kind(0)), carry, xs[1]), None

    carry = (x, k_all, v_all, *shared) + kept.start(x)
    if attn_inputs is not None and not isinstance(params.layers, tuple):
        raise ValueError("attn_inputs takes a model's layers unstacked (`params.unstack_layers`)")
    if isinstance(params.layers, tuple):  # unstacked (see `unstack_layers`): an unrolled loop
        for layer, lp in enumerate(params.layers):
            carry = run(lambda c, lp=lp, layer=layer: _layer_once(
                cfg, backend, inputs, *tables[cfg.layer_kind(layer)], c, (lp, jnp.int32(layer)), layout, kv_dtype,
                *cfg.layer_kind(layer), attn_inputs if layer == 0 else None), carry, jnp.int32(layer))
    elif cfg.mamba is not None:  # a hybrid model's attention and Mamba layers, unrolled
        carry, conv, ssm = hybrid_layers(cfg, params, carry, kv.conv, kv.ssm, inputs, lambda i, lp, c, j, mixer: _layer(
            cfg, backend, inputs, *tables[cfg.layer_kind(i)], c, (lp, jnp.int32(j)), layout, kv_dtype,
            *cfg.layer_kind(i), mixer=mixer)[0], chunked=backend != "xla", keep=kept.keep)
        kv = dataclasses.replace(kv, conv=conv, ssm=ssm)
    elif cfg.uniform_layers and cfg.moe_layer_step == 1:
        first = 0
        if params.dense_layers is not None:  # dense first layers, then the MoE ones
            first = cfg.first_dense_layers
            carry, _ = jax.lax.scan(step, carry, (params.dense_layers, jnp.arange(first, dtype=jnp.int32)))
        carry, _ = jax.lax.scan(step, carry, (params.layers, jnp.arange(first, cfg.num_layers, dtype=jnp.int32)))
    else:  # stacked layers that attend differently (Gemma, SmolLM3) or alternate dense and MoE MLPs (Llama 4
        # Maverick): a loop over the repeating groups of layers
        first = cfg.first_dense_layers if params.dense_layers is not None else 0  # (dense first layers: K-EXAONE's)
        period = math.lcm(cfg.period_from(first), cfg.moe_layer_step)

        def one(layer, like: int, carry):  # `layer` attends as layer `like` (static) does, with its kind of MLP
            dense = params.dense_layers is not None and cfg.dense_layer(like)
            stack = params.dense_layers if dense else params.layers
            i = cfg.stack_index(layer, dense)
            lp = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), stack)
            xs = (lp, jnp.asarray(layer, jnp.int32))
            return run(lambda c: _layer(cfg, backend, inputs, *tables[cfg.layer_kind(like)], c, xs, layout, kv_dtype,
                                        *cfg.layer_kind(like)), carry, xs[1])

        def group(g, carry):  # layers first + g * period on, `period` of them, each with its place's window and rotation
            for j in range(period):
                carry = one(first + g * period + j, first + j, carry)
            return carry

        for layer in range(first):
            carry = one(layer, layer, carry)
        whole = (cfg.num_layers - first) // period
        carry = jax.lax.fori_loop(0, whole, group, carry) if whole else carry  # (none: a group's places past L)
        for layer in range(first + whole * period, cfg.num_layers):  # past the last whole group
            carry = one(layer, layer, carry)
    carry = kept.keep(carry, cfg.num_layers)
    x, k_all, v_all = carry[:3]
    with jax.named_scope("lm_head"):
        logits = lm_head(params, cfg, x[inputs.logits_indices])  # [R, V]
    if k_all.dtype != kv.k.dtype:
        k_all, v_all = jax.lax.bitcast_convert_type(k_all, kv.k.dtype), jax.lax.bitcast_convert_type(v_all, kv.k.dtype)
    kv = dataclasses.replace(kv, k=k_all.reshape(kv.k.shape), v=v_all.reshape(kv.v.shape))
    if return_hidden and aux_layers:
        return logits, kv, x, kept.states(carry[3])
    if return_hidden:
        return logits, kv, x
    return logits, kv
