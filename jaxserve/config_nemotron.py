"""Nemotron-H configs (`NemotronHForCausalLM`: NVIDIA's Nemotron-H, Nemotron Nano 2): blocks of one part each, a
Mamba-2 mixer, attention without rotary embedding or an ungated squared-ReLU MLP, each normed before it and added to
the residual. Read as the hybrid layers they make (`config_mamba.MambaConfig`): each mixer block with the MLP block
after it as one layer, a mixer not followed by an MLP alone (`no_mlp`), an MLP not after a mixer alone (`no_mixer`)."""

from __future__ import annotations

import math
from typing import Any

from jaxserve.errors import UnsupportedModelError

# The blocks' kinds: transformers' names, its older ones and the pattern's characters (`hybrid_override_pattern`).
_BLOCKS = {"linear_attention": "M", "mamba": "M", "M": "M", "full_attention": "*", "attention": "*", "*": "*",
           "mlp": "-", "-": "-", "moe": "E", "E": "E"}
# Keys older configs spell another way (transformers reads both).
_ALIASES = {"n_groups": "mamba_n_groups", "conv_kernel": "mamba_d_conv", "use_conv_bias": "mamba_conv_bias",
            "time_step_limit": "mamba_dt_limit"}


def is_nemotron_h(d: dict[str, Any]) -> bool:
    return d.get("model_type") == "nemotron_h" or "NemotronHForCausalLM" in (d.get("architectures") or [])


def nemotron_blocks(d: dict[str, Any]) -> str:
    """The config's blocks as a pattern ("M-M*-": Mamba, MLP, Mamba, attention, MLP)."""
    blocks = d.get("layers_block_type") or d.get("layer_types") or d.get("hybrid_override_pattern")
    if not blocks:
        raise UnsupportedModelError("a Nemotron-H config needs layers_block_type or hybrid_override_pattern")
    unknown = sorted({str(b) for b in blocks} - set(_BLOCKS))
    if unknown:
        raise UnsupportedModelError(f"Nemotron-H block kinds {unknown} are not supported")
    return "".join(_BLOCKS[b] for b in blocks)


def pair_blocks(pattern: str) -> list[tuple[str, bool]]:
    """Layers from blocks: (mixer "M", "*" or "" for none, whether an MLP or MoE block follows it)."""
    layers: list[tuple[str, bool]] = []
    for b in pattern:
        if b in "-E" and layers and layers[-1][0] and not layers[-1][1]:
            layers[-1] = (layers[-1][0], True)
        else:
            layers.append(("", True) if b in "-E" else (b, False))
    return layers


def nemotron_h(d: dict[str, Any]) -> dict[str, Any]:
    """A Nemotron-H config as the hybrid model it is (Granite 4.0-H's keys: `config_mamba.mamba_config` reads
    them), with transformers' `NemotronHConfig` defaults; any other config as it is."""
    if not is_nemotron_h(d):
        return d
    pattern = nemotron_blocks(d)
    if "E" in pattern and "-" in pattern:
        raise UnsupportedModelError("a Nemotron-H model of both MLP and MoE blocks is not supported")
    if "E" in pattern and d.get("mlp_bias"):
        raise UnsupportedModelError("Nemotron-H's MoE blocks with mlp_bias (a biased shared expert) are not supported")
    if "M" not in pattern or "*" not in pattern:
        raise UnsupportedModelError(f"a Nemotron-H model needs Mamba and attention blocks, got {pattern!r}")
    for key, value, default in (("mamba_hidden_act", d.get("mamba_hidden_act"), "silu"),
                                ("mlp_hidden_act", d.get("mlp_hidden_act"), "relu2"),
                                ("sliding_window", d.get("sliding_window"), None),
                                ("attention_bias", d.get("attention_bias"), False)):  # (transformers' has none)
        if value not in (None, default):
            raise UnsupportedModelError(f"Nemotron-H with {key} {value!r} is not supported")
    get = lambda key, default: d.get(key, d.get(_ALIASES.get(key, key), default))  # noqa: E731
    layers = pair_blocks(pattern)
    heads = d.get("num_attention_heads", 32)
    return {**d, "model_type": "nemotron_h", "num_hidden_layers": len(layers), "num_attention_heads": heads,
            "num_key_value_heads": d.get("num_key_value_heads") or heads,
            "head_dim": d.get("head_dim") or d.get("attention_head_dim") or 128,
            "intermediate_size": d.get("intermediate_size", 21504), "hidden_act": "relu2",
            "rms_norm_eps": d.get("layer_norm_epsilon", 1e-5),
            "layer_types": [{"M": "mamba", "*": "attention", "": "mlp"}[m] for m, _ in layers],
            "mamba_no_mlp": [i for i, (_, mlp) in enumerate(layers) if not mlp],
            "mamba_n_heads": d.get("mamba_num_heads", 128), "mamba_d_head": d.get("mamba_head_dim", 64),
            "mamba_d_state": d.get("ssm_state_size", 128), "mamba_n_groups": get("n_groups", 8),
            "mamba_d_conv": get("conv_kernel", 4), "mamba_conv_bias": get("use_conv_bias", True),
            "mamba_proj_bias": d.get("use_bias", False), "time_step_limit": get("time_step_limit", (0.0, math.inf)),
            **dict.fromkeys(("num_local_experts", "n_routed_experts"), d.get("n_routed_experts", 8) if "E" in pattern else 0),
            "moe_intermediate_size": d.get("moe_intermediate_size", 7688)}


def nemotron_hf(cfg: Any) -> dict[str, Any]:
    """A Nemotron-H model's own HF config keys (the inverse of `nemotron_h`)."""
    m = cfg.mamba
    blocks = []
    for i in range(cfg.num_layers):
        if i not in m.no_mixer:
            blocks.append("linear_attention" if i in m.layers else "full_attention")
        if i not in m.no_mlp:
            blocks.append("mlp")
    moe = {"n_routed_experts": cfg.num_experts, "moe_intermediate_size": cfg.moe_intermediate_size,
           "moe_shared_expert_intermediate_size": cfg.shared_expert_intermediate_size, "n_shared_experts": 1,
           "n_group": cfg.expert_groups, "topk_group": cfg.expert_topk_groups, "norm_topk_prob": cfg.norm_topk_prob,
           "routed_scaling_factor": cfg.routed_scaling_factor, "moe_latent_size": cfg.moe_latent_size or None
           } if cfg.num_experts else {}
    if cfg.num_experts:
        blocks = ["moe" if b == "mlp" else b for b in blocks]
    return {**moe, "layers_block_type": blocks, "num_hidden_layers": len(blocks), "mlp_hidden_act": "relu2",
            "layer_norm_epsilon": cfg.rms_norm_eps, "mamba_num_heads": m.num_heads, "mamba_head_dim": m.head_dim,
            "ssm_state_size": m.state_size, "n_groups": m.n_groups, "conv_kernel": m.conv_kernel,
            "use_conv_bias": m.conv_bias, "use_bias": m.proj_bias, "mlp_bias": cfg.mlp_bias,
            "time_step_limit": [m.time_step_min, m.time_step_max]}
