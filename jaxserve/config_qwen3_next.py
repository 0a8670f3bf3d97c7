"""Qwen3-Next and Qwen3.5 configs (`Qwen3NextForCausalLM`, `Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`, and the
language model of Qwen3.5's image-text checkpoints): Gated DeltaNet layers ("linear_attention") beside attention
whose output is gated per channel by a sigmoid of a second query projection, every RMSNorm scaled by (1 + w), q and k
normed per head, a quarter of each head rotated (Qwen3.5's by M-RoPE, as Qwen3-VL's: an image's tokens by their
place in it); experts with a gated shared expert (Qwen3-Next, Qwen3.5-MoE) or a
dense MLP (Qwen3.5). Read as a hybrid model (`config_mamba.MambaConfig`, kind "gated_delta"): each DeltaNet layer
keeps a convolution state and a [value heads, value dim, key dim] state per sequence."""

from __future__ import annotations

from typing import Any

from jaxserve.errors import UnsupportedModelError

GATED_DELTA_FAMILIES: tuple[str, ...] = ("qwen3_next", "qwen3_5")  # Qwen3-Next's q/k/v/z and b/a projections fused
_TYPES = {"qwen3_next": "qwen3_next", "qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5", "qwen3_5": "qwen3_5",
          "qwen3_5_moe": "qwen3_5"}
_ARCHS = {"Qwen3NextForCausalLM": "qwen3_next", "Qwen3_5ForCausalLM": "qwen3_5", "Qwen3_5MoeForCausalLM": "qwen3_5"}


def _family(d: dict[str, Any]) -> str | None:
    return next((_ARCHS[a] for a in d.get("architectures") or [] if a in _ARCHS), None) or _TYPES.get(
        d.get("model_type", ""))


def qwen3_next(d: dict[str, Any]) -> dict[str, Any]:
    """A Qwen3-Next or Qwen3.5 config in Granite 4.0-H's keys (its DeltaNet layers as "mamba" layers of kind
    "gated_delta": value heads as the scan's heads, value dim as their width, key dim as the state, key heads as the
    groups sharing q and k), with transformers' defaults; any other config as it is."""
    family = _family(d)
    if family is None:
        return d
    layers = int(d.get("num_hidden_layers", 48 if family == "qwen3_next" else 32))
    every = int(d.get("full_attention_interval", 4))
    kinds = d.get("layer_types") or ["linear_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
    unknown = sorted(set(kinds) - {"linear_attention", "full_attention"})
    if unknown:
        raise UnsupportedModelError(f"{family} layer types {unknown} are not supported")
    if d.get("mlp_only_layers") or int(d.get("decoder_sparse_step", 1)) != 1:
        raise UnsupportedModelError(f"{family} with dense layers between the MoE layers (mlp_only_layers / "
                                    "decoder_sparse_step) is not supported")
    if d.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{family} with hidden_act {d['hidden_act']!r} is not supported (silu)")
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    # Qwen3.5's multimodal rotary sections, interleaved as Qwen3-VL's (transformers' default where none is given;
    # pairs past the sections turn by the temporal position)
    section = rope.pop("mrope_section", None) or [11, 11, 10]
    if rope.pop("mrope_interleaved", True) is not True:
        raise UnsupportedModelError(f"{family} with mrope_interleaved false is not supported (its sections interleave)")
    mrope = {"mrope_section": [int(n) for n in section], "mrope_interleaved": True} if family == "qwen3_5" else {}
    rope.setdefault("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))
    if "rope_theta" in d:
        rope.setdefault("rope_theta", d["rope_theta"])
    experts = int(d.get("num_experts") or 0)
    moe = {"num_experts": experts, "num_experts_per_tok": int(d.get("num_experts_per_tok", 10)),
           "moe_intermediate_size": int(d.get("moe_intermediate_size", 512)),
           "shared_expert_intermediate_size": int(d.get("shared_expert_intermediate_size", 512)),
           # (Qwen3.5-MoE's router always renormalizes its top k)
           "norm_topk_prob": bool(d.get("norm_topk_prob", True))} if experts else {
        "num_experts": 0, "moe_intermediate_size": 0, "shared_expert_intermediate_size": 0}
    heads = int(d.get("num_attention_heads", 16))
    return {**d, "architectures": [next(a for a, f in _ARCHS.items() if f == family)], "model_type": family,
            "num_hidden_layers": layers, "hidden_size": int(d.get("hidden_size", 2048 if experts else 4096)),
            "num_attention_heads": heads, "num_key_value_heads": d.get("num_key_value_heads") or heads,
            "head_dim": int(d.get("head_dim", 256)), "rms_norm_eps": d.get("rms_norm_eps", 1e-6),
            "max_position_embeddings": d.get("max_position_embeddings", 32768), "rope_parameters": rope,
            "rope_scaling": None, "attention_bias": bool(d.get("attention_bias", False)), **moe, **mrope,
            "layer_types": ["mamba" if k == "linear_attention" else "attention" for k in kinds],
            "mamba_kind": "gated_delta", "mamba_n_heads": int(d.get("linear_num_value_heads", 32)),
            "mamba_d_head": int(d.get("linear_value_head_dim", 128)),
            "mamba_d_state": int(d.get("linear_key_head_dim", 128)),
            "mamba_n_groups": int(d.get("linear_num_key_heads", 16)),
            "mamba_d_conv": int(d.get("linear_conv_kernel_dim", 4)), "mamba_conv_bias": False, "mamba_proj_bias": False}


def qwen3_next_hf(cfg: Any) -> dict[str, Any]:
    """A Qwen3-Next or Qwen3.5 model's own HF config keys (the inverse of `qwen3_next`)."""
    m = cfg.mamba
    d = {"layer_types": ["linear_attention" if i in m.layers else "full_attention" for i in range(cfg.num_layers)],
         "linear_num_value_heads": m.num_heads, "linear_value_head_dim": m.head_dim, "linear_key_head_dim": m.state_size,
         "linear_num_key_heads": m.n_groups, "linear_conv_kernel_dim": m.conv_kernel,
         "partial_rotary_factor": cfg.rotary_dims / cfg.head_dim}
    if cfg.family == "qwen3_5":
        d.update(architectures=["Qwen3_5MoeForCausalLM" if cfg.num_experts else "Qwen3_5ForCausalLM"],
                 model_type="qwen3_5_moe_text" if cfg.num_experts else "qwen3_5_text")
    if cfg.num_experts:
        d.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                 moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
                 shared_expert_intermediate_size=cfg.shared_expert_intermediate_size)
    return d
