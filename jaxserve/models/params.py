"""Parameters of a Llama-family model, declared once abstractly.

Every parameter is declared by a `ParamInfo` (shape, logical axis names, initializer). From that single declaration
come random initialization for tests, the loader's target shapes, abstract `ShapeDtypeStruct`s, and the logical axes
that sharding rules map to a mesh. Per-layer parameters are stacked on a leading `layers` axis so the forward pass
scans them."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import UNIT_NORM_FAMILIES, ModelConfig
from jaxserve.config_families import EMBED_NORM_FAMILIES, HEAD_BIAS_FAMILIES, LEARNED_POSITION_FAMILIES
from jaxserve.models.quantized import quantized_info

Init = Literal["normal", "ones", "zeros"]


@dataclass(frozen=True)
class ParamInfo:
    """Abstract description of one parameter array (a pytree leaf)."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: Init = "normal"
    dtype: Any = None  # None: the model's dtype; a quantized weight's parts name their own (`quantized`)

    def __post_init__(self) -> None:
        if len(self.shape) != len(self.axes):
            raise ValueError(f"shape {self.shape} and axes {self.axes} differ in rank")


@jax.tree_util.register_dataclass
@dataclass
class LayerParams:
    """Decoder layer parameters, each stacked on a leading `layers` axis."""

    attn_norm: Any  # [L, E]; None where the model norms outputs only (`ModelConfig.input_norms`)
    wq: Any  # [L, E, Hq, D]
    wk: Any  # [L, E, Hkv, D]
    wv: Any  # [L, E, Hkv, D]
    wo: Any  # [L, Hq, D, E]
    mlp_norm: Any  # [L, E]
    w_gate: Any = None  # [L, E, F]; None in a MoE model
    w_up: Any = None  # [L, E, F]
    w_down: Any = None  # [L, F, E]
    bq: Any = None  # [L, Hq, D]
    bk: Any = None  # [L, Hkv, D]
    bv: Any = None  # [L, Hkv, D]
    bo: Any = None  # [L, E]
    q_norm: Any = None  # [L, D], or [L, Hq, D] normed over all heads at once (`ModelConfig.qk_norm_heads`)
    k_norm: Any = None  # [L, D], or [L, Hkv, D]
    q_norm_b: Any = None  # [L, D]: the q and k LayerNorms' biases (Phi's `qk_layernorm`)
    k_norm_b: Any = None
    b_gate: Any = None  # [L, F]
    b_up: Any = None  # [L, F]
    b_down: Any = None  # [L, E]
    router: Any = None  # [L, E, X]: MoE routing logits per expert
    router_bias: Any = None  # [L, X] float32: added to the scores to choose experts (not to their weights)
    b_router: Any = None  # [L, X]: the router's logits' bias (gpt-oss)
    we_gate: Any = None  # [L, X, E, Fe]: the X experts' MLPs (E: `ModelConfig.expert_width`)
    we_up: Any = None  # [L, X, E, Fe]
    we_down: Any = None  # [L, X, Fe, E]
    we_latent_in: Any = None  # [L, E, Le]: a latent MoE's projections to its experts' width
    we_latent_out: Any = None  # [L, Le, E]: ... and back
    be_gate: Any = None  # [L, X, Fe]: the experts' biases (gpt-oss)
    be_up: Any = None  # [L, X, Fe]
    be_down: Any = None  # [L, X, E]
    sinks: Any = None  # [L, Hq] float32: each head's attention-sink logit (gpt-oss)
    ws_gate: Any = None  # [L, E, Fs]: the shared expert (Qwen2-MoE)
    ws_up: Any = None  # [L, E, Fs]
    ws_down: Any = None  # [L, Fs, E]
    ws_mix: Any = None  # [L, E]: the shared expert's sigmoid gate
    xielu: Any = None  # [L, 4] float32: Apertus' xIELU per layer, its alpha_p, alpha_n (before softplus), beta, eps
    k_scale: Any = None  # [L] float32: a float8 KV cache holds K / k_scale (checkpoint or calibrated scales)
    v_scale: Any = None  # [L] float32: ... and V / v_scale
    post_attn_norm: Any = None  # [L, E]: Gemma's norms of the attention's and the MLP's outputs
    attn_norm_b: Any = None  # [L, E]: LayerNorm biases of attn_norm and mlp_norm (`ModelConfig.norm_bias`)
    mlp_norm_b: Any = None
    post_mlp_norm: Any = None  # [L, E]
    # Fused layouts, only in unstacked per-layer params (`unstack_layers(..., fuse=True)`), which then leave wq/wk/wv,
    # wo, w_gate/w_up and w_down None: fewer, larger matmuls per layer, each matrix out-major ([out, in], the
    # checkpoints' own order), which XLA:CPU's dots read fastest.
    wqkv: Any = None  # [(Hq + 2 * Hkv) * D, E]: q, k and v projections stacked
    w_gate_up: Any = None  # [2 * F, E]: gate and up projections stacked
    wo_t: Any = None  # [E, Hq * D]
    w_down_t: Any = None  # [E, F]
    lora: Any = None  # `lora.LoraLayer`: LoRA adapter slots, in an engine that serves adapters
    # Multi-head latent attention (`config_mla`; wk and wv None, wq [L, Rq or E, Hq, D], wo [L, Hq, Dv, E]):
    wq_a: Any = None  # [L, E, Rq]: the queries' bottleneck (`q_lora_rank`), normed by q_a_norm [L, Rq]
    q_a_norm: Any = None
    wkv_a: Any = None  # [L, E, R + Dr]: each token's latent (normed by kv_a_norm [L, R]) and rotary key
    kv_a_norm: Any = None
    w_uk: Any = None  # [L, Hq, D - Dr, R]: the keys' unrotated dims from the latent, absorbed into the queries
    w_uv: Any = None  # [L, Hq, R, Dv]: the values from the latent, applied to the attention's output
    # ... and DeepSeek Sparse Attention's indexer (`models.sparse_mla`):
    idx_wq: Any = None  # [L, Rq, Hi, Di]: its queries, from the queries' bottleneck
    idx_wk: Any = None  # [L, E, Di]: its one key per token, LayerNormed by idx_k_norm, idx_k_norm_b [L, Di]
    idx_k_norm: Any = None
    idx_k_norm_b: Any = None
    idx_w: Any = None  # [L, E, Hi] float32: each head's weight per token
    # A hybrid model's Mamba-2 mixer (`config_mamba.MambaConfig`; Lm stacked layers, `Params.mamba_layers`):
    m_in: Any = None  # [Lm, E, z + conv + heads]: the input projection (z, x B C, dt)
    m_in_b: Any = None  # [Lm, z + conv + heads]
    m_conv: Any = None  # [Lm, conv, kernel]: the depthwise causal convolution of x, B and C
    m_conv_b: Any = None  # [Lm, conv]
    m_dt_bias: Any = None  # [Lm, heads] float32
    m_a_log: Any = None  # [Lm, heads] float32: each head's decay rate is -exp(a_log)
    m_d: Any = None  # [Lm, heads] float32: the skip connection's weight
    m_norm: Any = None  # [Lm, inner]: the gated norm's weight
    m_out: Any = None  # [Lm, inner, E]
    m_out_b: Any = None  # [Lm, E]
    # ... and Jamba's (`models.mamba1`: A [Lm, inner, state]): dt (low-rank), B, C from x, each RMSNormed
    m_x: Any = None  # [Lm, inner, dt_rank + 2 state]
    m_dt: Any = None  # [Lm, dt_rank, inner]: dt up to each channel
    m_dt_norm: Any = None  # [Lm, dt_rank]
    m_b_norm: Any = None  # [Lm, state]
    m_c_norm: Any = None  # [Lm, state]
    # Gemma 4's (`models.gemma4`): each layer's output scale; its experts beside the MLP, routed on the layer's input
    # normed without weight times router_scale, their weights times expert_scale; its norms of the MLP's output
    # (mlp_out_norm), of the experts' input and output (moe_norm, moe_out_norm), before post_mlp_norm norms their sum
    layer_scalar: Any = None  # [L]
    router_scale: Any = None  # [L, E]
    expert_scale: Any = None  # [L, X]
    mlp_out_norm: Any = None  # [L, E]
    moe_norm: Any = None  # [L, E]
    moe_out_norm: Any = None  # [L, E]
    # ... and the E2B/E4B models' input embedding per layer (P wide), gated by the layer's output, projected, normed
    ple_gate: Any = None  # [L, E, P]
    ple_out: Any = None  # [L, P, E]
    ple_post_norm: Any = None  # [L, E]


@jax.tree_util.register_dataclass
@dataclass
class Params:
    """All parameters of a Llama-family model.

    `layers` is one `LayerParams` stacked on a leading `layers` axis (how checkpoints load, shard and save), or a
    tuple of per-layer `LayerParams` (`unstack_layers`), which the forward pass runs as an unrolled loop: XLA:CPU
    copies a layer's weights out of a stacked array before every matmul, so on the CPU the unstacked form reads
    each weight once per step instead of twice."""

    embed: Any  # [V, E]
    layers: LayerParams | tuple[LayerParams, ...]
    final_norm: Any  # [E]
    lm_head: Any = None  # [E, V]; None when tied to `embed`
    final_norm_b: Any = None  # [E]: final_norm's LayerNorm bias (`ModelConfig.norm_bias`)
    lm_head_b: Any = None  # [V]: the LM head's bias (Phi's: `config_families.HEAD_BIAS_FAMILIES`)
    pos_embed: Any = None  # [max positions, E]: learned absolute positions (GPT-2's), added to the embeddings
    embed_norm: Any = None  # [E]: a LayerNorm of the embeddings (BLOOM's `word_embeddings_layernorm`), and its bias
    embed_norm_b: Any = None
    # An untied head stored out-major, only with fused per-layer params (`unstack_layers(..., fuse=True)`),
    # which then leave `lm_head` None: at 4-32 rows XLA:CPU runs SmolLM2's head 3.1-3.8x faster this way.
    lm_head_t: Any = None  # [V, E]
    dense_layers: LayerParams | None = None  # a MoE model's dense layers (GLM-4.5's first ones, Llama 4 Maverick's
    # every second: `ModelConfig.dense_layer`), or Gemma 4's full-attention layers (wider heads), stacked apart (None
    # once unstacked: one tuple); `layers` the rest
    # A hybrid model (`ModelConfig.mamba`): `layers` holds every layer's norms and MLP, and the mixers apart, the
    # attention layers' projections (their other fields None) and the Mamba layers' (`LayerParams.m_*`).
    attn_layers: LayerParams | None = None
    mamba_layers: LayerParams | None = None
    mlp_layers: LayerParams | None = None  # ... the MLPs apart when some layers have none (`MambaConfig.no_mlp`)
    # Gemma 4 E2B/E4B's input embeddings per layer (`models.gemma4.per_layer_inputs`): a table [Vp, L * P], the
    # projection of the model's input embedding to them [E, L * P], and their norm [P]
    ple_embed: Any = None
    ple_proj: Any = None
    ple_norm: Any = None


def declare_params(cfg: ModelConfig) -> Params:
    """The abstract parameter tree of `cfg` (leaves are `ParamInfo`)."""
    E, V, k = cfg.hidden_size, cfg.vocab_size, cfg.num_dense_layers
    norm: Init = "zeros" if cfg.family in UNIT_NORM_FAMILIES else "ones"  # Gemma scales by (1 + w)
    if cfg.mamba is not None:
        from jaxserve.models.mamba import declare_hybrid

        return declare_hybrid(cfg, _declare_layers)
    ple = cfg.gemma4.ple_width * cfg.num_layers if cfg.gemma4 is not None else 0
    return Params(
        embed=ParamInfo((V, E), ("vocab", "embed")),
        layers=_declare_layers(cfg, cfg.num_layers - k, bool(cfg.num_experts)),
        final_norm=ParamInfo((E,), ("embed",), norm),
        lm_head=None if cfg.tie_word_embeddings else ParamInfo((E, V), ("embed", "vocab")),
        dense_layers=(_declare_layers(cfg.kind_config(False), k, bool(cfg.num_experts)) if cfg.gemma4 is not None
                      else _declare_layers(cfg, k, False)) if k else None,  # (Gemma 4's: its full-attention layers)
        final_norm_b=ParamInfo((E,), ("embed",), "zeros") if cfg.norm_bias else None,
        lm_head_b=ParamInfo((V,), ("vocab",), "zeros") if cfg.family in HEAD_BIAS_FAMILIES else None,
        pos_embed=ParamInfo((cfg.max_position_embeddings, E), (None, "embed")) if cfg.family in
        LEARNED_POSITION_FAMILIES else None,
        embed_norm=ParamInfo((E,), ("embed",), "ones") if cfg.family in EMBED_NORM_FAMILIES else None,
        embed_norm_b=ParamInfo((E,), ("embed",), "zeros") if cfg.family in EMBED_NORM_FAMILIES else None,
        ple_embed=ParamInfo((cfg.gemma4.ple_vocab, ple), (None, None)) if ple else None,  # (whole on each device)
        ple_proj=ParamInfo((E, ple), ("embed", None)) if ple else None,
        ple_norm=ParamInfo((cfg.gemma4.ple_width,), (None,), "ones") if ple else None,
    )


def _declare_layers(cfg: ModelConfig, L: int, moe: bool) -> LayerParams:
    """`L` stacked layers of `cfg`, with experts (`moe`) or a dense MLP."""
    E, F = cfg.hidden_size, cfg.intermediate_size
    Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def p(shape: tuple[int, ...], axes: tuple[str | None, ...], init: Init = "normal", dtype: Any = None) -> ParamInfo:
        return ParamInfo(shape, axes, init, dtype)

    norm: Init = "zeros" if cfg.family in UNIT_NORM_FAMILIES else "ones"
    if cfg.kv_lora_rank:
        from jaxserve.models.mla import declare_mla

        layers = declare_mla(cfg, L)
    else:
        layers = LayerParams(
            attn_norm=p((L, E), ("layers", "embed"), norm) if cfg.input_norms else None,
            wq=p((L, E, Hq, cfg.q_head_dim), ("layers", "embed", "q_heads", "head_dim")),  # (gate after query)
            wk=p((L, E, Hkv, D), ("layers", "embed", "kv_heads", "head_dim")),
            wv=p((L, E, Hkv, D), ("layers", "embed", "kv_heads", "head_dim")),
            wo=p((L, Hq, D, E), ("layers", "q_heads", "head_dim", "embed")),
            mlp_norm=p((L, E), ("layers", "embed"), norm) if cfg.input_norms and cfg.mlp_own_norm else None,
        )
    if cfg.norm_bias:
        layers.attn_norm_b = p((L, E), ("layers", "embed"), "zeros")
        layers.mlp_norm_b = None if layers.mlp_norm is None else p((L, E), ("layers", "embed"), "zeros")
    if cfg.output_norms:
        layers.post_attn_norm = p((L, E), ("layers", "embed"), norm)
        layers.post_mlp_norm = p((L, E), ("layers", "embed"), norm)
    if moe:
        X, Fe, Fs, Ew = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size, cfg.expert_width
        layers.router = p((L, E, X), ("layers", "embed", None))
        layers.we_latent_in = p((L, E, Ew), ("layers", "embed", None)) if cfg.moe_latent_size else None
        layers.we_latent_out = p((L, Ew, E), ("layers", None, "embed")) if cfg.moe_latent_size else None
        if cfg.router_bias:
            layers.router_bias = p((L, X), ("layers", None), "zeros", jnp.float32)
        layers.we_gate = p((L, X, Ew, Fe), ("layers", "experts", "embed", "expert_mlp")) if cfg.gated_mlp else None
        layers.we_up = p((L, X, Ew, Fe), ("layers", "experts", "embed", "expert_mlp"))
        layers.we_down = p((L, X, Fe, Ew), ("layers", "experts", "expert_mlp", "embed"))
        if cfg.swiglu_limit is not None:  # gpt-oss: biased router and experts
            layers.b_router = p((L, X), ("layers", None), "zeros")
            layers.be_gate = p((L, X, Fe), ("layers", "experts", "expert_mlp"), "zeros")
            layers.be_up = p((L, X, Fe), ("layers", "experts", "expert_mlp"), "zeros")
            layers.be_down = p((L, X, E), ("layers", "experts", "embed"), "zeros")
        if Fs:
            layers.ws_gate = p((L, E, Fs), ("layers", "embed", "mlp")) if cfg.gated_mlp else None
            layers.ws_up = p((L, E, Fs), ("layers", "embed", "mlp"))
            layers.ws_down = p((L, Fs, E), ("layers", "mlp", "embed"))
            if cfg.shared_expert_gated:  # Qwen's shared expert is gated; Granite's is not
                layers.ws_mix = p((L, E), ("layers", "embed"))
    else:
        layers.w_gate = p((L, E, F), ("layers", "embed", "mlp")) if cfg.gated_mlp else None
        layers.w_up = p((L, E, F), ("layers", "embed", "mlp"))
        layers.w_down = p((L, F, E), ("layers", "mlp", "embed"))
    if cfg.attention_bias:
        layers.bq = p((L, Hq, cfg.q_head_dim), ("layers", "q_heads", "head_dim"), "zeros")
        layers.bk = p((L, Hkv, D), ("layers", "kv_heads", "head_dim"), "zeros")
        layers.bv = p((L, Hkv, D), ("layers", "kv_heads", "head_dim"), "zeros")
        if cfg.output_bias:
            layers.bo = p((L, E), ("layers", "embed"), "zeros")
    if cfg.qk_norm and cfg.qk_norm_weights_per_head:
        layers.q_norm = p((L, Hq, D), ("layers", "q_heads", "head_dim"), norm)
        layers.k_norm = p((L, Hkv, D), ("layers", "kv_heads", "head_dim"), norm)
    elif cfg.qk_norm:
        layers.q_norm = p((L, D), ("layers", "head_dim"), norm)
        layers.k_norm = p((L, D), ("layers", "head_dim"), norm)
        if cfg.family == "phi":  # (LayerNorms with biases)
            layers.q_norm_b, layers.k_norm_b = (p((L, D), ("layers", "head_dim"), "zeros") for _ in "qk")
    if cfg.hidden_act == "xielu":
        layers.xielu = p((L, 4), ("layers", None), "zeros", jnp.float32)
    if cfg.mlp_bias:
        layers.b_gate = p((L, F), ("layers", "mlp"), "zeros") if cfg.gated_mlp else None
        layers.b_up = p((L, F), ("layers", "mlp"), "zeros")
        layers.b_down = p((L, E), ("layers", "embed"), "zeros")
    if cfg.attention_sinks:
        layers.sinks = p((L, Hq), ("layers", "q_heads"), "zeros", jnp.float32)
    if cfg.kv_cache_scales:
        layers.k_scale = p((L,), ("layers",), "ones")
        layers.v_scale = p((L,), ("layers",), "ones")
    if cfg.gemma4 is not None:
        from jaxserve.models.gemma4 import declare_gemma4

        declare_gemma4(cfg, layers, L, moe, p)
    if cfg.weight_quant:  # weights kept quantized: each projection as its stored value and scale
        layers = LayerParams(**{f.name: quantized_info(f.name, getattr(layers, f.name), cfg.weight_quant)
                                for f in dataclasses.fields(layers)})
    return layers


ATTENTION_FIELDS = ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo", "q_norm", "k_norm", "sinks", "k_scale", "v_scale")
MLP_FIELDS = ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down", "router", "router_bias", "b_router", "we_gate",
              "we_up", "we_down", "we_latent_in", "we_latent_out", "be_gate", "be_up", "be_down", "ws_gate", "ws_up", "ws_down", "ws_mix",
              "xielu")


def _float_only(cfg: ModelConfig) -> None:
    if cfg.weight_quant:
        raise ValueError("random weights are drawn in float: draw them for the config without weight_quant, then "
                         "quantize them (models.quantized.quantize_layers)")


def _is_info(x: Any) -> bool:
    return isinstance(x, ParamInfo)


def abstract_params(cfg: ModelConfig, dtype: jnp.dtype) -> Params:
    """`ShapeDtypeStruct` leaves, for lowering without materializing weights."""
    return jax.tree.map(lambda i: jax.ShapeDtypeStruct(i.shape, i.dtype or dtype), declare_params(cfg),
                        is_leaf=_is_info)


def logical_axes(cfg: ModelConfig) -> Params:
    """The logical axis names of every parameter (tuples as leaves)."""
    return jax.tree.map(lambda i: i.axes, declare_params(cfg), is_leaf=_is_info)


def init_params(cfg: ModelConfig, key: jax.Array, dtype: jnp.dtype = jnp.float32, scale: float = 0.02) -> Params:
    """Random parameters for tests: normal(0, scale) matrices, unit norms, zero biases. Drawn on the host in blocks
    (`_normal_block`), so not traceable: call it outside `jax.jit`."""
    _float_only(cfg)
    infos, treedef = jax.tree.flatten(declare_params(cfg), is_leaf=_is_info)
    leaves = []
    for i, info in enumerate(infos):
        kind = jnp.dtype(info.dtype or dtype)  # (a router's bias is float32 in any model)
        if info.init in ("ones", "zeros"):
            leaves.append(jnp.asarray(np.full(info.shape, 1 if info.init == "ones" else 0, kind)))
            continue
        n = math.prod(info.shape)
        blocks = [np.asarray(_normal_block(key, i, j)) for j in range(-(-n // _BLOCK))]
        drawn = np.concatenate([np.zeros(0, np.float32), *blocks])[:n]
        leaves.append(jnp.asarray((scale * drawn).reshape(info.shape).astype(kind)))
    return jax.tree.unflatten(treedef, leaves)


_BLOCK = 1 << 16


@jax.jit
def _normal_block(key: jax.Array, leaf: jax.Array, j: jax.Array) -> jax.Array:
    # Drawn in blocks of one shape: drawn in each leaf's own shape, every new shape compiled a few programs of its
    # own (3-5 s for a small model's leaves); these compile once.
    return jax.random.normal(jax.random.fold_in(jax.random.fold_in(key, leaf), j), (_BLOCK,), jnp.float32)


def param_paths(tree: Params) -> dict[str, Any]:
    """Flatten a parameter tree to {"layers.wq": leaf, "dense_layers.wq": leaf, ...} (None fields omitted)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(tree):
        value = getattr(tree, f.name)
        if value is None:
            continue
        if isinstance(value, LayerParams):
            for g in dataclasses.fields(value):
                sub = getattr(value, g.name)
                if sub is not None:
                    out[f"{f.name}.{g.name}"] = sub
        else:
            out[f.name] = value
    return out


def from_param_paths(cfg: ModelConfig, flat: dict[str, Any]) -> Params:
    """Inverse of `param_paths` for the declaration of `cfg`."""
    decl = declare_params(cfg)

    def stack(name: str) -> LayerParams | None:
        layers = getattr(decl, name)
        return None if layers is None else LayerParams(**{  # (a field the declaration leaves None stays None)
            g.name: flat[f"{name}.{g.name}"] if getattr(layers, g.name) is not None else None
            for g in dataclasses.fields(layers)})

    return Params(embed=flat["embed"], layers=stack("layers"), final_norm=flat["final_norm"],
                  lm_head=flat.get("lm_head"), final_norm_b=flat.get("final_norm_b"), lm_head_b=flat.get("lm_head_b"),
                  **{k: flat.get(k) for k in ("pos_embed", "embed_norm", "embed_norm_b")},
                  dense_layers=stack("dense_layers"),
                  attn_layers=stack("attn_layers"), mamba_layers=stack("mamba_layers"), mlp_layers=stack("mlp_layers"),
                  **{k: flat.get(k) for k in ("ple_embed", "ple_proj", "ple_norm")})
