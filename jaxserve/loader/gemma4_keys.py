"""Gemma 4's layer tensors beyond Gemma 3's (`config_gemma4`): each layer's output scale (`layer_scalar`), the
full-attention layers' missing value projection (their keys serve as values), and in the MoE form the router's
projection, input scale and per-expert scales and the norms around the experts beside the MLP (the experts
themselves packed, read as Qwen3-VL-MoE's: `family_names`, `gpt_oss_keys`)."""

from __future__ import annotations

from typing import Any


def gemma4_targets(cfg: Any, t: dict[str, tuple]) -> dict[str, tuple]:
    """`t` (`keymap._layer_targets` of `cfg`: the windowed layers' config, or with `cfg.gemma4.full_layers` the
    full-attention layers') with Gemma 4's own names."""
    E, X = cfg.hidden_size, cfg.num_experts
    t = {**t, "layer_scalar": ("layers.layer_scalar", lambda w: w.reshape(()), (1,))}
    if cfg.gemma4.full_layers and cfg.gemma4.k_eq_v:
        del t["self_attn.v_proj.weight"]
    if X:
        t |= {"router.proj.weight": ("layers.router", lambda w: w.T, (X, E)),
              "router.scale": ("layers.router_scale", lambda w: w, (E,)),
              "router.per_expert_scale": ("layers.expert_scale", lambda w: w, (X,)),
              **{f"{name}.weight": (f"layers.{path}", lambda w: w, (E,)) for name, path in (
                  ("post_feedforward_layernorm_1", "mlp_out_norm"), ("pre_feedforward_layernorm_2", "moe_norm"),
                  ("post_feedforward_layernorm_2", "moe_out_norm"))}}
    return t
