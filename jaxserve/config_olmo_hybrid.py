"""AI2's OLMo Hybrid (`OlmoHybridForCausalLM`): Gated DeltaNet layers ("linear_attention", three of four by default)
beside OLMo 3's attention layers. Read as a hybrid model (`config_mamba.MambaConfig`, kind "gated_delta", as
Qwen3.5's layers): q, k and v projected apart and convolved together, the gate its own projection (`g_proj`), beta
doubled where `linear_allow_neg_eigval` (a range of [0, 2]), the output's gated norm with eps 1e-5.

The two kinds of layer norm in opposite places: a DeltaNet layer before its mixer and its MLP (Llama's), an attention
layer after its attention and after its MLP (OLMo 2's; q and k normed over all their heads). Released checkpoints
rotate nothing (`rope_parameters` null or without `rope_theta`: NoPE on every attention layer)."""

from __future__ import annotations

from typing import Any

from jaxserve.errors import UnsupportedModelError

FAMILY = "olmo_hybrid"


def olmo_hybrid(d: dict[str, Any]) -> dict[str, Any]:
    """An OLMo Hybrid config in Granite 4.0-H's keys (its DeltaNet layers as "mamba" layers of kind "gated_delta":
    value heads as the scan's heads, value dim as their width, key dim as the state, key heads as the groups sharing
    q and k; `position_embedding_type` "rope" where its attention is rotated), with transformers' defaults; any other
    config as it is."""
    if d.get("model_type") != FAMILY and "OlmoHybridForCausalLM" not in (d.get("architectures") or []):
        return d
    n, heads, hidden = int(d["num_hidden_layers"]), int(d["num_attention_heads"]), int(d["hidden_size"])
    kinds = d.get("layer_types") or ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
    if "full_attention" not in kinds:  # (transformers' default for fewer than four layers)
        kinds = [*kinds[:-1], "full_attention"]
    unknown = sorted(set(kinds) - {"linear_attention", "full_attention"})
    if unknown:
        raise UnsupportedModelError(f"olmo_hybrid layer types {unknown} are not supported")
    if d.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"olmo_hybrid with hidden_act {d['hidden_act']!r} is not supported (silu)")
    key_heads = int(d.get("linear_num_key_heads") or heads)
    key_dim = int(d.get("linear_key_head_dim") or int(0.75 * hidden / key_heads))
    rope = d.get("rope_parameters") or d.get("rope_scaling")
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    if theta is None and rope is None and "rope_theta" in d:
        theta = d["rope_theta"]
    out = {k: v for k, v in d.items() if k not in ("rope_parameters", "rope_scaling")}
    if theta is not None:
        out["rope_parameters"] = {**rope, "rope_theta": theta} if isinstance(rope, dict) else {
            "rope_type": "default", "rope_theta": theta}
    return {**out, "architectures": ["OlmoHybridForCausalLM"], "model_type": FAMILY,
            "num_key_value_heads": d.get("num_key_value_heads") or heads,
            "position_embedding_type": "rope" if theta is not None else None,
            "layer_types": ["mamba" if k == "linear_attention" else "attention" for k in kinds],
            "mamba_kind": "gated_delta", "mamba_n_heads": int(d.get("linear_num_value_heads") or heads),
            "mamba_d_head": int(d.get("linear_value_head_dim") or 2 * key_dim), "mamba_d_state": key_dim,
            "mamba_n_groups": key_heads, "mamba_d_conv": int(d.get("linear_conv_kernel_dim", 4)),
            "mamba_conv_bias": False, "mamba_proj_bias": False, "mamba_norm_eps": 1e-5,
            "mamba_beta_scale": 2.0 if d.get("linear_allow_neg_eigval", True) else 1.0}


def olmo_hybrid_hf(cfg: Any) -> dict[str, Any]:
    """An OLMo Hybrid model's own HF config keys (the inverse of `olmo_hybrid`)."""
    m = cfg.mamba
    rotated = any(cfg.no_rope_layers or (1,))
    return {"layer_types": ["linear_attention" if i in m.layers else "full_attention" for i in range(cfg.num_layers)],
            "linear_num_value_heads": m.num_heads, "linear_value_head_dim": m.head_dim,
            "linear_key_head_dim": m.state_size, "linear_num_key_heads": m.n_groups,
            "linear_conv_kernel_dim": m.conv_kernel, "linear_allow_neg_eigval": m.beta_scale == 2.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta} if rotated else None}
