"""Xiaomi's MiMo-V2-Flash (`MiMoV2FlashForCausalLM`): its `ModelConfig` fields from an HF config, and back
(`ModelConfig.from_hf`, `config_hf.config_to_hf`).

Windowed layers (with attention sinks, twice the full layers' KV heads, their own rotary base) beside full ones (every
sixth); queries and keys `head_dim` wide (192), values narrower (`v_head_dim`, 128) and scaled by
`attention_value_scale`; a partial rotary embedding; a dense first layer, then DeepSeek-V3's sigmoid-routed experts
with no shared expert. jaxserve serves it with uniform layers (`loader.mimo_keys`): every layer holds the windowed
layers' KV heads (a full layer's each head twice, which is the same grouped attention), values padded with zeros to
`head_dim` (the output projection's extra inputs zero), a full layer's sinks -inf (no sink); the value scale is
applied to attention's output (`ModelConfig.attention_value_scale`).
"""

from __future__ import annotations

from typing import Any

from jaxserve.config_fields import leading_dense_layers
from jaxserve.errors import UnsupportedModelError

FAMILY = "mimo_v2_flash"


def mimo_layer_types(d: dict[str, Any]) -> tuple[str, ...]:
    """Its layers' kinds: `layer_types`, else the first layer and every sixth full, the rest windowed."""
    n = d["num_hidden_layers"]
    return tuple(d.get("layer_types") or ["full_attention" if i == 0 or not (i + 1) % 6 else "sliding_attention"
                                          for i in range(n)])


def mimo_hub_config(d: dict[str, Any]) -> dict[str, Any]:
    """A MiMo-V2-Flash config in the form its released checkpoints use (`hybrid_layer_pattern`, `moe_layer_freq`,
    `swa_*` keys, `sliding_window_size`) as the transformers form the rest reads; any other config as it is. The
    windowed layers must have the full ones' query heads and widths and twice their KV heads, sinks only on the
    windowed layers, and no shared expert (as every released model). A config in transformers' form without
    `rope_parameters` gets transformers' defaults (bases 5e6 and 1e4, a third of each head rotated)."""
    if d.get("model_type") != FAMILY and "MiMoV2FlashForCausalLM" not in (d.get("architectures") or []):
        return d
    if "hybrid_layer_pattern" not in d:
        default = {"full_attention": 5e6, "sliding_attention": 1e4}
        return d if d.get("rope_parameters") else {**d, "rope_parameters": {
            kind: {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.334}
            for kind, theta in default.items()}}
    n, kv = d["num_hidden_layers"], d["num_key_value_heads"]
    want = {"swa_num_attention_heads": d["num_attention_heads"], "swa_num_key_value_heads": 2 * kv,
            "swa_head_dim": d.get("head_dim"), "swa_v_head_dim": d.get("v_head_dim"),
            "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False}
    for key, value in want.items():
        if d.get(key, value) != value:
            raise UnsupportedModelError(f"MiMo-V2-Flash with {key} {d[key]!r} is not supported (jaxserve serves "
                                        f"{value!r})")
    if d.get("n_shared_experts"):
        raise UnsupportedModelError("MiMo-V2-Flash with shared experts is not supported")
    partial = d.get("partial_rotary_factor", 1.0)
    rope = lambda theta: {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": partial}  # noqa: E731
    out = {k: v for k, v in d.items() if k not in ("hybrid_layer_pattern", "moe_layer_freq", "sliding_window_size")}
    out.update(layer_types=["sliding_attention" if p else "full_attention" for p in d["hybrid_layer_pattern"]],
               mlp_layer_types=["sparse" if f else "dense" for f in d.get("moe_layer_freq") or [0] + [1] * (n - 1)],
               rope_parameters={"full_attention": rope(d.get("rope_theta", 5e6)),
                                "sliding_attention": rope(d.get("swa_rope_theta", 1e4))},
               rms_norm_eps=d.get("layernorm_epsilon", d.get("rms_norm_eps", 1e-5)))
    if d.get("sliding_window_size") is not None:  # (it attends that many keys before the query: transformers' + 1)
        out["sliding_window"] = d["sliding_window_size"] + 1
    return out


def _rope(d: dict[str, Any], kind: str) -> dict[str, Any]:
    rope = d.get("rope_parameters") or {}
    return rope.get(kind) or {}


def mimo_kv_repeat(cfg: Any) -> int:
    """How many times a full layer's KV heads are held: 2 where windowed layers (which have twice as many) set the
    count (`num_kv_heads` is the config's `num_key_value_heads` times this)."""
    return 2 if "sliding_attention" in (cfg.layer_types or ()) else 1


def mimo_kv_heads(d: dict[str, Any]) -> int:
    """`ModelConfig.num_kv_heads`: the windowed layers' KV heads (twice the config's), where there are any."""
    return (2 if "sliding_attention" in mimo_layer_types(d) else 1) * int(d["num_key_value_heads"])


def mimo_layer_fields(d: dict[str, Any]) -> dict[str, Any]:
    """Its layers' kinds (the window from `sliding_window`), the windowed layers' rotary base, its values' width and
    scale."""
    if d.get("attention_bias"):
        raise UnsupportedModelError("MiMo-V2-Flash with attention_bias is not supported")
    full, local = _rope(d, "full_attention"), _rope(d, "sliding_attention")
    for rope in (full, local):
        if rope.get("rope_type", "default") != "default":
            raise UnsupportedModelError(f"MiMo-V2-Flash rope_type {rope['rope_type']!r} is not supported")
    if full.get("partial_rotary_factor", 0.334) != local.get("partial_rotary_factor", 0.334):
        raise UnsupportedModelError("MiMo-V2-Flash with other partial rotary factors on its windowed and full layers "
                                    "is not supported")
    head_dim = int(d.get("head_dim") or 192)
    value_dim = int(d.get("v_head_dim") or head_dim)
    if not 0 < value_dim <= head_dim:
        raise UnsupportedModelError(f"MiMo-V2-Flash v_head_dim {value_dim} must be in 1..head_dim ({head_dim})")
    scale = d.get("attention_value_scale")
    return dict(layer_types=mimo_layer_types(d), rope_local_theta=float(local.get("rope_theta", 10000.0)),
                attention_value_dim=value_dim, attention_value_scale=1.0 if scale is None else float(scale))


def mimo_moe_fields(d: dict[str, Any]) -> dict[str, Any]:
    """Its experts' fields."""
    return dict(num_experts=int(d.get("n_routed_experts", 256)), num_experts_per_tok=int(d.get("num_experts_per_tok", 8)),
                moe_intermediate_size=int(d.get("moe_intermediate_size", 2048)),
                norm_topk_prob=bool(d.get("norm_topk_prob", True)), router_scoring="sigmoid", router_bias=True,
                expert_groups=int(d.get("n_group") or 1), expert_topk_groups=int(d.get("topk_group") or 1),
                routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0),
                first_dense_layers=leading_dense_layers(d, "MiMo-V2-Flash", 1))


def mimo_hf(cfg: Any) -> dict[str, Any]:
    """MiMo-V2-Flash's own config keys (the inverse of `mimo_fields`)."""
    partial = cfg.rotary_dims / cfg.head_dim
    rope = lambda theta: {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": partial}  # noqa: E731
    return dict(
        num_key_value_heads=cfg.num_kv_heads // mimo_kv_repeat(cfg), layer_types=list(cfg.layer_types),
        v_head_dim=cfg.attention_value_dim, attention_value_scale=cfg.attention_value_scale,
        rope_parameters={"full_attention": rope(cfg.rope_theta), "sliding_attention": rope(cfg.rope_local_theta)},
        n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob, n_group=cfg.expert_groups,
        topk_group=cfg.expert_topk_groups, routed_scaling_factor=cfg.routed_scaling_factor,
        mlp_layer_types=["dense"] * cfg.first_dense_layers + ["sparse"] * (cfg.num_layers - cfg.first_dense_layers))
