"""LFM2 configs (`Lfm2ForCausalLM`: Liquid AI's LFM2): short gated convolutions beside grouped-query attention (q and
k normed per head), a SwiGLU MLP in every layer (LFM2-MoE, `Lfm2MoeForCausalLM`: experts after its dense first
layers, chosen by sigmoid scores and a bias). Read as a hybrid model (`config_mamba.MambaConfig`, kind
"short_conv"): each convolution layer keeps a convolution state per sequence and no SSM state."""

from __future__ import annotations

from typing import Any

from jaxserve.errors import UnsupportedModelError


def is_lfm2(d: dict[str, Any]) -> bool:
    return d.get("model_type") in ("lfm2", "lfm2_moe") or bool(
        {"Lfm2ForCausalLM", "Lfm2MoeForCausalLM"} & set(d.get("architectures") or []))


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
    layers = int(d.get("num_hidden_layers", 32))
    kinds = d.get("layer_types")
    if kinds is None:
        attn = d.get("full_attn_idxs")
        kinds = ["full_attention" if attn is None or i in attn else "conv" for i in range(layers)]
    unknown = sorted(set(kinds) - {"conv", "full_attention"})
    if unknown:
        raise UnsupportedModelError(f"LFM2 layer types {unknown} are not supported")
    hidden, heads = int(d.get("hidden_size", 2560)), int(d.get("num_attention_heads", 32))
    bias = bool(d.get("conv_bias", False))
    # LFM2-MoE's (`Lfm2MoeConfig`'s defaults): its dense first layers' MLP as wide as the config says
    moe = {"num_local_experts": int(d.get("num_experts", 32)), "num_experts_per_tok": int(d.get("num_experts_per_tok", 4)),
           "moe_intermediate_size": int(d.get("moe_intermediate_size", 1792)),
           "num_dense_layers": int(d.get("num_dense_layers", 2)),
           "intermediate_size": int(d.get("intermediate_size", 7168))} if _is_moe(d) else {
        "num_local_experts": 0, "moe_intermediate_size": 0, "intermediate_size": lfm2_mlp_width(d)}
    return {**d, "model_type": "lfm2", "num_hidden_layers": layers, "hidden_size": hidden,
            "num_attention_heads": heads, "num_key_value_heads": d.get("num_key_value_heads") or heads, **moe,
            "rms_norm_eps": d.get("norm_eps", 1e-5),
            "tie_word_embeddings": d.get("tie_embedding", d.get("tie_word_embeddings", True)),
            "rope_theta": d.get("rope_theta", 1000000.0), "max_position_embeddings": d.get("max_position_embeddings",
                                                                                          128000),
            "layer_types": ["mamba" if k == "conv" else "attention" for k in kinds], "mamba_kind": "short_conv",
            "mamba_n_heads": 1, "mamba_d_head": hidden, "mamba_d_state": 0, "mamba_n_groups": 1,
            "mamba_d_conv": int(d.get("conv_L_cache", 3)), "mamba_conv_bias": bias, "mamba_proj_bias": bias}


def lfm2_hf(cfg: Any) -> dict[str, Any]:
    """An LFM2 model's own HF config keys (the inverse of `lfm2`; its MLP width given as is)."""
    m = cfg.mamba
    d = {"layer_types": ["conv" if i in m.layers else "full_attention" for i in range(cfg.num_layers)],
         "norm_eps": cfg.rms_norm_eps, "conv_L_cache": m.conv_kernel, "conv_bias": m.conv_bias}
    if not cfg.num_experts:
        return {**d, "block_ff_dim": cfg.intermediate_size, "block_auto_adjust_ff_dim": False}
    return {**d, "architectures": ["Lfm2MoeForCausalLM"], "model_type": "lfm2_moe", "num_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok, "moe_intermediate_size": cfg.moe_intermediate_size,
            "num_dense_layers": cfg.first_dense_layers, "use_expert_bias": cfg.router_bias,
            "routed_scaling_factor": cfg.routed_scaling_factor, "norm_topk_prob": cfg.norm_topk_prob}
