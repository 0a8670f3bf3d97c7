"""LFM2 configs (`Lfm2ForCausalLM`: Liquid AI's LFM2): short gated convolutions beside grouped-query attention (q and
k normed per head), a SwiGLU MLP in every layer (LFM2-MoE, `Lfm2MoeForCausalLM`: experts after its dense first
layers, chosen by sigmoid scores and a bias). Read as a hybrid model (`config_mamba.MambaConfig`, kind
"short_conv"): each convolution layer keeps a convolution state per sequence and no SSM state.

LFM3 (`Lfm3ForCausalLM`) keeps LFM2's convolutions and adds windowed attention layers beside its full ones, each kind
on its own rotary embedding (the windowed layers' by `rope_local_theta`; the full ones' proportional: the leading half
of each head's pairs turned), a sigmoid gate on each head's output from the layer's normed input (`g_proj`,
`gate_proj` in its checkpoints, read as one more channel of each head's query: `ModelConfig.attn_gate_width`), norms
after each layer's mixer or attention and its MLP as well as before (Gemma's four places), and an MLP
`intermediate_size` wide."""

from __future__ import annotations

from typing import Any

from jaxserve.errors import UnsupportedModelError

# `Lfm3Config`'s rotary embeddings where a config gives none: the windowed layers' plain, the full ones' proportional.
LFM3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
             "full_attention": {"rope_type": "proportional", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5}}


def is_lfm2(d: dict[str, Any]) -> bool:
    return d.get("model_type") in ("lfm2", "lfm2_moe", "lfm3") or bool(
        {"Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "Lfm3ForCausalLM"} & set(d.get("architectures") or []))


def _is_lfm3(d: dict[str, Any]) -> bool:
    return d.get("model_type") == "lfm3" or "Lfm3ForCausalLM" in (d.get("architectures") or [])


def _lfm3_kinds(d: dict[str, Any], layers: int) -> list[str]:
    """An LFM3 config's layer kinds, as `Lfm3Config` makes them where it gives none (of each four, the third full
    attention, the first windowed but for layer 0)."""
    if d.get("layer_types") is not None:
        return list(d["layer_types"])
    return ["full_attention" if i % 4 == 2 else "sliding_attention" if i % 4 == 0 and i > 0 else "conv"
            for i in range(layers)]


def lfm3_fields(d: dict[str, Any]) -> dict[str, Any]:
    """An LFM3 config's (read by `lfm2`) layers that differ: its windowed attention layers (its convolution layers
    listed as full ones, which nothing reads) on their own unscaled rotary base."""
    local = (d.get("rope_parameters") or {}).get("sliding_attention") or {"rope_theta": 10_000.0}
    if local.get("rope_type", "default") != "default":
        raise UnsupportedModelError(f"LFM3's windowed layers' rotary embedding {local} is not supported (default)")
    return dict(layer_types=tuple("sliding_attention" if k == "sliding_attention" else "full_attention"
                                  for k in d["lfm3_layer_types"]), rope_local_theta=float(local["rope_theta"]))


def _is_moe(d: dict[str, Any]) -> bool:
    return d.get("model_type") == "lfm2_moe" or "Lfm2MoeForCausalLM" in (d.get("architectures") or [])


def lfm2_mlp_width(d: dict[str, Any]) -> int:
    """The MLP's width as `Lfm2MLP` makes it: 2/3 of `intermediate_size` (`block_ff_dim`), times
    `block_ffn_dim_multiplier`, rounded up to `block_multiple_of` (with `block_auto_adjust_ff_dim`)."""
    width = int(d.get("block_ff_dim", d.get("intermediate_size", 12288)))
    if d.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        if d.get("block_ffn_dim_multiplier", 1.0) is not None:
            multiple = int(d.get("block_multiple_of", 256))
            width = int(d.get("block_ffn_dim_multiplier", 1.0) * width)
            width = multiple * ((width + multiple - 1) // multiple)
    return width


def lfm2(d: dict[str, Any]) -> dict[str, Any]:
    """An LFM2 config in Granite 4.0-H's keys (its convolution layers as "mamba" layers of kind "short_conv"), with
    transformers' `Lfm2Config` defaults; any other config as it is."""
    if not is_lfm2(d):
        return d
    layers, lfm3 = int(d.get("num_hidden_layers", 32)), _is_lfm3(d)
    kinds = _lfm3_kinds(d, layers) if lfm3 else d.get("layer_types")
    if kinds is None:
        attn = d.get("full_attn_idxs")
        kinds = ["full_attention" if attn is None or i in attn else "conv" for i in range(layers)]
    unknown = sorted(set(kinds) - {"conv", "full_attention", *(["sliding_attention"] if lfm3 else [])})
    if unknown:
        raise UnsupportedModelError(f"{'LFM3' if lfm3 else 'LFM2'} layer types {unknown} are not supported")
    if lfm3:
        _check_lfm3(d)
    hidden, heads = int(d.get("hidden_size", 2560)), int(d.get("num_attention_heads", 32))
    bias = bool(d.get("conv_bias", False))
    # LFM2-MoE's (`Lfm2MoeConfig`'s defaults): its dense first layers' MLP as wide as the config says
    moe = {"num_local_experts": int(d.get("num_experts", 32)), "num_experts_per_tok": int(d.get("num_experts_per_tok", 4)),
           "moe_intermediate_size": int(d.get("moe_intermediate_size", 1792)),
           "num_dense_layers": int(d.get("num_dense_layers", 2)),
           "intermediate_size": int(d.get("intermediate_size", 7168))} if _is_moe(d) else {
        "num_local_experts": 0, "moe_intermediate_size": 0,
        "intermediate_size": int(d.get("intermediate_size", 7680)) if lfm3 else lfm2_mlp_width(d)}
    lfm3_keys = {"architectures": ["Lfm3ForCausalLM"], "lfm3_layer_types": kinds,
                 "sliding_window": d.get("sliding_window", 256),
                 "rope_parameters": d.get("rope_parameters") or LFM3_ROPE} if lfm3 else {"model_type": "lfm2"}
    return {**d, **lfm3_keys, "num_hidden_layers": layers, "hidden_size": hidden,
            "num_attention_heads": heads, "num_key_value_heads": d.get("num_key_value_heads") or heads, **moe,
            "rms_norm_eps": d.get("norm_eps", 1e-5),
            "tie_word_embeddings": d.get("tie_embedding", d.get("tie_word_embeddings", True)),
            "rope_theta": d.get("rope_theta", 1000000.0), "max_position_embeddings": d.get("max_position_embeddings",
                                                                                          128000),
            "layer_types": ["mamba" if k == "conv" else "attention" for k in kinds], "mamba_kind": "short_conv",
            "mamba_n_heads": 1, "mamba_d_head": hidden, "mamba_d_state": 0, "mamba_n_groups": 1,
            "mamba_d_conv": int(d.get("conv_L_cache", 7 if lfm3 else 3)), "mamba_conv_bias": bias,
            "mamba_proj_bias": bias}


def _check_lfm3(d: dict[str, Any]) -> None:
    """Refuse, by name, the LFM3 options the released models leave at their defaults and jaxserve does not read."""
    for key, want in (("use_attention_gate", True), ("use_sandwich_norm", True), ("attention_bias", False)):
        if bool(d.get(key, want)) != want:
            raise UnsupportedModelError(f"LFM3 with {key}={d[key]} is not supported ({want} only)")


def lfm2_hf(cfg: Any) -> dict[str, Any]:
    """An LFM2 or LFM3 model's own HF config keys (the inverse of `lfm2`; its MLP width given as is)."""
    m = cfg.mamba
    if cfg.family == "lfm3":
        kinds = ["conv" if i in m.layers else cfg.layer_types[i] for i in range(cfg.num_layers)]
        full = {**cfg.rope_scaling.to_hf(), "rope_theta": cfg.rope_theta} if cfg.rope_scaling.rope_type != "default" \
            else {"rope_type": "default", "rope_theta": cfg.rope_theta}
        return {"architectures": ["Lfm3ForCausalLM"], "model_type": "lfm3", "layer_types": kinds,
                "norm_eps": cfg.rms_norm_eps, "conv_L_cache": m.conv_kernel, "conv_bias": m.conv_bias,
                "sliding_window": cfg.sliding_window, "rope_parameters": {
                    "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_theta},
                    "full_attention": full}}
    d = {"layer_types": ["conv" if i in m.layers else "full_attention" for i in range(cfg.num_layers)],
         "norm_eps": cfg.rms_norm_eps, "conv_L_cache": m.conv_kernel, "conv_bias": m.conv_bias}
    if not cfg.num_experts:
        return {**d, "block_ff_dim": cfg.intermediate_size, "block_auto_adjust_ff_dim": False}
    return {**d, "architectures": ["Lfm2MoeForCausalLM"], "model_type": "lfm2_moe", "num_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok, "moe_intermediate_size": cfg.moe_intermediate_size,
            "num_dense_layers": cfg.first_dense_layers, "use_expert_bias": cfg.router_bias,
            "routed_scaling_factor": cfg.routed_scaling_factor, "norm_topk_prob": cfg.norm_topk_prob}
