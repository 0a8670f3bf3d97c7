"""Cohere's Command A MoE layers (`Cohere2MoeForCausalLM`): their `ModelConfig` fields from an HF config, and back
(`ModelConfig.from_hf`, `config_hf.config_to_hf`).

Command R7B's layers (`cohere2`: LayerNorm without bias, attention and the MLP side by side on one normed input,
three of four layers windowed and rotated, the global ones unrotated) with experts: dense first layers
(`first_k_dense_replace`, `prefix_dense_intermediate_size` wide, windowed by their own period
`prefix_dense_sliding_window_pattern`, and rotated when that period is 1), then experts `intermediate_size` wide
chosen by their logits' top-k and weighted by the softmax (or, renormalized by `norm_topk_prob`, the sigmoid) of
those, beside shared experts added to them or averaged with them (`shared_expert_combination_strategy`).
"""

from __future__ import annotations

from typing import Any

from jaxserve.errors import UnsupportedModelError

FAMILY = "cohere2_moe"


def _dense(d: dict[str, Any]) -> int:
    return int(d.get("first_k_dense_replace") or sum(t == "dense" for t in d.get("mlp_layer_types") or ()))


def cohere2_moe_layer_types(d: dict[str, Any]) -> tuple[str, ...]:
    """Its windowed and global layers: `layer_types`, else the dense layers' period, then the MoE layers'."""
    if d.get("layer_types"):
        return tuple(d["layer_types"])
    k, n = _dense(d), d["num_hidden_layers"]
    prefix, period = int(d.get("prefix_dense_sliding_window_pattern", 1)), int(d.get("sliding_window_pattern", 4))
    return tuple("sliding_attention" if (i + 1) % (prefix if j < k else period) else "full_attention"
                 for j, i in enumerate([*range(k), *range(n - k)]))


def cohere2_moe_fields(d: dict[str, Any]) -> dict[str, Any]:
    """Its layers' kinds, which of them rotate, its dense layers' width and its experts' fields."""
    if d.get("rms_norm_eps") is not None:
        raise UnsupportedModelError("cohere2_moe with rms_norm_eps (RMSNorm in place of its LayerNorm) is not supported")
    mlp = d.get("mlp_layer_types")
    k = _dense(d)
    if mlp and list(mlp) != ["dense"] * k + ["sparse"] * (d["num_hidden_layers"] - k):
        raise UnsupportedModelError(f"cohere2_moe mlp_layer_types {mlp} is not supported: dense layers first, then "
                                    "MoE layers")
    select, combine = d.get("expert_selection_fn", "softmax"), d.get("shared_expert_combination_strategy", "average")
    if select not in ("softmax", "sigmoid") or combine not in ("sum", "average"):
        raise UnsupportedModelError(f"cohere2_moe expert_selection_fn {select!r} / shared_expert_combination_strategy "
                                    f"{combine!r} is not supported (softmax or sigmoid; sum or average)")
    types = cohere2_moe_layer_types(d)
    rotate_dense = int(d.get("prefix_dense_sliding_window_pattern", 1)) == 1
    shared = int(d.get("num_shared_experts") or 0)
    half = 0.5 if combine == "average" and shared else 1.0
    return dict(
        layer_types=types, intermediate_size=int(d.get("prefix_dense_intermediate_size") or d["intermediate_size"]),
        no_rope_layers=tuple(int(t == "sliding_attention" or (i < k and rotate_dense)) for i, t in enumerate(types)),
        num_experts=int(d.get("num_experts", 8)), num_experts_per_tok=int(d.get("num_experts_per_tok", 2)),
        moe_intermediate_size=int(d["intermediate_size"]), first_dense_layers=k,
        shared_expert_intermediate_size=shared * int(d["intermediate_size"]),
        router_scoring=select, norm_topk_prob=select == "softmax" or bool(d.get("norm_topk_prob", True)),
        routed_scaling_factor=half, shared_expert_scale=half)


def cohere2_moe_hf(cfg: Any) -> dict[str, Any]:
    """Its own config keys (the inverse of `cohere2_moe_fields`)."""
    shared, rest = divmod(cfg.shared_expert_intermediate_size, cfg.moe_intermediate_size)
    k = cfg.first_dense_layers
    if rest:
        raise UnsupportedModelError(f"a shared expert {cfg.shared_expert_intermediate_size} wide is no whole number "
                                    f"of {cfg.moe_intermediate_size}-wide experts (the config counts them)")
    return dict(
        layer_types=list(cfg.layer_types), mlp_layer_types=["dense"] * k + ["sparse"] * (cfg.num_layers - k),
        sliding_window=cfg.sliding_window, intermediate_size=cfg.moe_intermediate_size,
        prefix_dense_intermediate_size=cfg.intermediate_size if k else None, num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok, num_shared_experts=shared,
        shared_expert_combination_strategy="average" if cfg.shared_expert_scale != 1.0 else "sum",
        expert_selection_fn=cfg.router_scoring, norm_topk_prob=cfg.norm_topk_prob,
        prefix_dense_sliding_window_pattern=1 if all(cfg.no_rope_layers[:k]) else 2)
