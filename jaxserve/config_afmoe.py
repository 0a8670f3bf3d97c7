"""Arcee's AFMoE (Trinity: `AfmoeForCausalLM`): its `ModelConfig` fields from an HF config, and back
(`ModelConfig.from_hf`, `config_hf.config_to_hf`).

Three of four layers windowed and rotated, the global ones unrotated (NoPE); q and k normed per head; attention's
output gated per channel by the sigmoid of its own projection (`self_attn.gate_proj`, read beside each head's query:
`ModelConfig.attn_gate_width`); a norm before and after each of attention and the MLP (Gemma's places, plain
weights); dense first layers (`num_dense_layers`), then experts chosen by sigmoid score plus a bias (`expert_bias`),
renormalized and scaled by `route_scale`, beside always-on shared experts; muP's embeddings times sqrt(hidden_size)
where `mup_enabled`.
"""

from __future__ import annotations

import math
from typing import Any

from jaxserve.errors import UnsupportedModelError


def afmoe_layer_types(d: dict[str, Any]) -> tuple[str, ...]:
    """Its windowed and global layers: `layer_types`, else every `global_attn_every_n_layers`-th layer global."""
    every = int(d.get("global_attn_every_n_layers") or 4)
    kinds = d.get("layer_types") or ["sliding_attention" if (i + 1) % every else "full_attention"
                                     for i in range(d["num_hidden_layers"])]
    return tuple(kinds)


def afmoe_layer_fields(d: dict[str, Any]) -> dict[str, Any]:
    """Its layers' kinds (the window from `sliding_window`) and its embeddings' scale."""
    if d.get("attention_bias"):  # (no released model has them; its gate projection has none)
        raise UnsupportedModelError("AFMoE with attention_bias is not supported")
    return dict(layer_types=afmoe_layer_types(d),
                embedding_multiplier=math.sqrt(d["hidden_size"]) if d.get("mup_enabled") else 1.0)


def afmoe_no_rope_layers(d: dict[str, Any]) -> tuple[int, ...]:
    """1 for its windowed layers (rotated), 0 for its global ones (NoPE)."""
    return tuple(int(k == "sliding_attention") for k in afmoe_layer_types(d))


def afmoe_moe_fields(d: dict[str, Any]) -> dict[str, Any]:
    """Its experts' fields."""
    width = int(d.get("moe_intermediate_size", 1408))
    dense = int(d.get("num_dense_layers", 1) or 0)
    if not 0 <= dense <= d["num_hidden_layers"]:
        raise UnsupportedModelError(f"AFMoE num_dense_layers {dense} is outside 0..{d['num_hidden_layers']}")
    return dict(num_experts=int(d.get("num_experts", 64)), num_experts_per_tok=int(d.get("num_experts_per_tok", 6)),
                moe_intermediate_size=width, norm_topk_prob=True, first_dense_layers=dense,
                shared_expert_intermediate_size=int(d.get("num_shared_experts", 2) or 0) * width,
                router_scoring="sigmoid", router_bias=True,
                routed_scaling_factor=float(d.get("route_scale", 1.0) or 1.0))


def afmoe_hf(cfg: Any) -> dict[str, Any]:
    """AFMoE's own config keys (the inverse of `afmoe_fields`)."""
    shared, rest = divmod(cfg.shared_expert_intermediate_size, cfg.moe_intermediate_size)
    if rest:
        raise UnsupportedModelError(f"a shared expert {cfg.shared_expert_intermediate_size} wide is no whole number "
                                    f"of {cfg.moe_intermediate_size}-wide experts (the config counts them)")
    return dict(layer_types=list(cfg.layer_types), sliding_window=cfg.sliding_window, num_experts=cfg.num_experts,
                num_experts_per_tok=cfg.num_experts_per_tok, moe_intermediate_size=cfg.moe_intermediate_size,
                num_shared_experts=shared, num_dense_layers=cfg.first_dense_layers,
                route_scale=cfg.routed_scaling_factor, mup_enabled=cfg.embedding_multiplier != 1.0)
