"""LG's K-EXAONE (`ExaoneMoeForCausalLM`): its `ModelConfig` fields from an HF config, and back (`ModelConfig.from_hf`,
`config_hf.config_to_hf`).

EXAONE 4's attention (q/k norms; three of four layers windowed, the global ones unrotated: `config_fields.exaone4_fields`)
in pre-norm layers, with DeepSeek-V3's experts: sigmoid scores with a bias for choosing (beside the router:
`mlp.e_score_correction_bias`) among the best groups, renormalized and scaled, beside shared experts; dense first layers
(`mlp_layer_types`, else `first_k_dense_replace`).
"""

from __future__ import annotations

from typing import Any

from jaxserve.config_fields import leading_dense_layers
from jaxserve.errors import UnsupportedModelError


def exaone_moe_fields(d: dict[str, Any]) -> dict[str, Any]:
    """K-EXAONE's experts' fields."""
    dense = leading_dense_layers(d, "K-EXAONE", 1)
    width = int(d.get("moe_intermediate_size", 1024))
    return dict(num_experts=int(d.get("num_experts", 64)), num_experts_per_tok=int(d.get("num_experts_per_tok", 8)),
                moe_intermediate_size=width, norm_topk_prob=bool(d.get("norm_topk_prob", True)),
                shared_expert_intermediate_size=int(d.get("num_shared_experts", 1)) * width, first_dense_layers=dense,
                router_scoring="sigmoid", router_bias=True, expert_groups=int(d.get("n_group") or 1),
                expert_topk_groups=int(d.get("topk_group") or 1),
                routed_scaling_factor=float(d.get("routed_scaling_factor", 2.5)))


def exaone_moe_hf(cfg: Any) -> dict[str, Any]:
    """K-EXAONE's expert keys (the inverse of `exaone_moe_fields`)."""
    shared, rest = divmod(cfg.shared_expert_intermediate_size, cfg.moe_intermediate_size)
    if rest:
        raise UnsupportedModelError(f"a shared expert {cfg.shared_expert_intermediate_size} wide is no whole number "
                                    f"of {cfg.moe_intermediate_size}-wide experts (the config counts them)")
    return dict(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
                num_shared_experts=shared, n_group=cfg.expert_groups, topk_group=cfg.expert_topk_groups,
                routed_scaling_factor=cfg.routed_scaling_factor, first_k_dense_replace=cfg.first_dense_layers,
                mlp_layer_types=["dense"] * cfg.first_dense_layers + ["sparse"] * (cfg.num_layers - cfg.first_dense_layers))
