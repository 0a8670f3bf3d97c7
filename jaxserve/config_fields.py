"""The ModelConfig fields particular to some families, read from their HF config (`ModelConfig.from_hf`)."""

from __future__ import annotations

from typing import Any

from jaxserve.errors import UnsupportedModelError


def gemma_fields(family: str, d: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """The ModelConfig fields particular to Gemma 2 and Gemma 3 text models, from their HF config."""
    num_layers = d["num_hidden_layers"]
    layer_types = d.get("layer_types")
    if not layer_types:
        if family == "gemma2":  # HF Gemma 2 windows the even layers
            layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
        else:  # Gemma 3: every `sliding_window_pattern`-th layer is global
            pattern = d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6
            layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                           for i in range(num_layers)]
    fields: dict[str, Any] = dict(
        layer_types=tuple(layer_types),
        hidden_act=d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh",
        query_pre_attn_scalar=float(d.get("query_pre_attn_scalar") or head_dim),
        attn_logit_softcap=d.get("attn_logit_softcapping"),
        final_logit_softcap=d.get("final_logit_softcapping"),
    )
    if family == "gemma3":
        local = (d.get("rope_parameters") or {}).get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise UnsupportedModelError(f"scaled rotary embeddings on the sliding layers ({local}) are not supported")
        fields["rope_local_theta"] = float(local.get("rope_theta") or d.get("rope_local_base_freq") or 10000.0)
    return fields


def int_if_whole(x: float | None) -> float | int | None:
    return int(x) if x is not None and float(x).is_integer() else x


def granite_fields(d: dict[str, Any]) -> dict[str, Any]:
    """Granite's scalars (transformers' defaults: 1.0 each; its attention scale is the multiplier itself)."""
    fields = {key: float(d.get(key, 1.0)) for key in ("embedding_multiplier", "attention_multiplier",
                                                     "residual_multiplier", "logits_scaling")}
    for key, value in fields.items():
        if not value > 0:
            raise UnsupportedModelError(f"granite {key} must be positive, got {value}")
    return fields
