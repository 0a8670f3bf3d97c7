"""AI21's Jamba (`JambaForCausalLM`): Mamba (the first, selective-scan form: `MambaConfig.kind` "mamba1") layers
beside attention layers without a rotary embedding (every `attn_layer_period`-th, from `attn_layer_offset`), every
layer's MLP dense or, every `expert_layer_period`-th, softmax-routed experts (top-k unrenormalized, as wide as the
dense MLP); Bamba's module names (`feed_forward`, `pre_ff_layernorm`, `final_layernorm`).

Its Mamba mixer: an input projection into x and a gate z, a causal depthwise convolution of x (SiLU), then from x a
low-rank step (RMSNormed, projected up to each channel, its bias and a softplus), B and C (each RMSNormed); each
channel's state of `mamba_d_state` decays by exp(dt A) per state dim and takes dt x B; y = C . state + D x, gated by
silu(z). Read as a hybrid model whose Mamba heads are its channels, one dim each."""

from __future__ import annotations

import math
from typing import Any

from jaxserve.errors import UnsupportedModelError

FAMILY = "jamba"


def jamba(d: dict[str, Any]) -> dict[str, Any]:
    """A Jamba config in Granite 4.0-H's keys (its layers' kinds listed, the Mamba layers' channels as heads of one
    dim, `mamba_dt_rank`; no rotary embedding), with transformers' defaults; any other config as it is."""
    if d.get("model_type") != FAMILY and "JambaForCausalLM" not in (d.get("architectures") or []):
        return d
    n, hidden = int(d["num_hidden_layers"]), int(d["hidden_size"])
    period, offset = int(d.get("attn_layer_period", 8)), int(d.get("attn_layer_offset", 4))
    if not 0 <= offset < period:
        raise UnsupportedModelError(f"jamba attn_layer_offset ({offset}) must be in [0, attn_layer_period ({period}))")
    if d.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"jamba with hidden_act {d['hidden_act']!r} is not supported (silu)")
    inner = int(d.get("mamba_expand", 2)) * hidden
    rank = d.get("mamba_dt_rank", "auto")
    return {**d, "architectures": ["JambaForCausalLM"], "model_type": FAMILY,
            "num_key_value_heads": d.get("num_key_value_heads") or d["num_attention_heads"],
            "layer_types": ["attention" if i % period == offset else "mamba" for i in range(n)],
            "position_embedding_type": None, "mamba_kind": "mamba1", "mamba_n_heads": inner, "mamba_d_head": 1,
            "mamba_d_state": int(d.get("mamba_d_state", 16)), "mamba_n_groups": 1,
            "mamba_d_conv": int(d.get("mamba_d_conv", 4)), "mamba_conv_bias": bool(d.get("mamba_conv_bias", True)),
            "mamba_proj_bias": bool(d.get("mamba_proj_bias", False)),
            "mamba_dt_rank": math.ceil(hidden / 16) if rank == "auto" else int(rank)}


def jamba_moe_fields(d: dict[str, Any]) -> dict[str, Any]:
    """Its experts: as wide as the dense MLP, every `expert_layer_period`-th layer (the last of each period: jaxserve
    holds no other offset), softmax-routed, the top k unrenormalized."""
    experts = int(d.get("num_local_experts") or d.get("num_experts") or 0)
    if experts <= 1:
        return {"num_experts": 0}
    period, offset = int(d.get("expert_layer_period", 2)), int(d.get("expert_layer_offset", 1))
    if offset != period - 1:
        raise UnsupportedModelError(f"jamba with expert_layer_offset {offset} is not supported (experts in the last "
                                    f"layer of each expert_layer_period ({period}): offset {period - 1})")
    return dict(num_experts=experts, num_experts_per_tok=int(d.get("num_experts_per_tok", 2)),
                moe_intermediate_size=int(d["intermediate_size"]), norm_topk_prob=False, moe_layer_step=period)


def jamba_hf(cfg: Any) -> dict[str, Any]:
    """A Jamba model's own HF config keys (the inverse of `jamba` and `jamba_moe_fields`)."""
    m = cfg.mamba
    attn = cfg.attention_layers
    period = attn[1] - attn[0] if len(attn) > 1 else cfg.num_layers
    return {"attn_layer_period": period, "attn_layer_offset": attn[0], "mamba_d_state": m.state_size,
            "mamba_d_conv": m.conv_kernel, "mamba_expand": m.inner // cfg.hidden_size, "mamba_dt_rank": m.dt_rank,
            "mamba_conv_bias": m.conv_bias, "mamba_proj_bias": m.proj_bias,
            "num_experts": cfg.num_experts or 1, "num_experts_per_tok": cfg.num_experts_per_tok or 2,
            "expert_layer_period": cfg.moe_layer_step, "expert_layer_offset": cfg.moe_layer_step - 1}
