"""Gemma 4's tensors beyond Gemma 3's (`config_gemma4`): each layer's output scale (`layer_scalar`), the
full-attention layers' missing value projection (their keys serve as values); in the MoE form the router's
projection, input scale and per-expert scales and the norms around the experts beside the MLP (the experts
themselves packed, read as Qwen3-VL-MoE's: `family_names`, `gpt_oss_keys`); E2B/E4B's per-layer inputs, the layers
that share keys (their own key projections unread) and their double-wide MLPs."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np


def gemma4_targets(cfg: Any, t: dict[str, tuple]) -> dict[str, tuple]:
    """`t` (`keymap._layer_targets` of `cfg`: the windowed layers' config, or with `cfg.gemma4.full_layers` the
    full-attention layers') with Gemma 4's own names."""
    E, X = cfg.hidden_size, cfg.num_experts
    t = {**t, "layer_scalar": ("layers.layer_scalar", lambda w: w.reshape(()), (1,))}
    if cfg.gemma4.full_layers and cfg.gemma4.k_eq_v:
        del t["self_attn.v_proj.weight"]
    if cfg.gemma4.ple_width:
        P = cfg.gemma4.ple_width
        t |= {"per_layer_input_gate.weight": ("layers.ple_gate", lambda w: w.T, (P, E)),
              "per_layer_projection.weight": ("layers.ple_out", lambda w: w.T, (E, P)),
              "post_per_layer_input_norm.weight": ("layers.ple_post_norm", lambda w: w, (E,))}
    if X:
        t |= {"router.proj.weight": ("layers.router", lambda w: w.T, (X, E)),
              "router.scale": ("layers.router_scale", lambda w: w, (E,)),
              "router.per_expert_scale": ("layers.expert_scale", lambda w: w, (X,)),
              **{f"{name}.weight": (f"layers.{path}", lambda w: w, (E,)) for name, path in (
                  ("post_feedforward_layernorm_1", "mlp_out_norm"), ("pre_feedforward_layernorm_2", "moe_norm"),
                  ("post_feedforward_layernorm_2", "moe_out_norm"))}}
    return t


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MLP = {"mlp.gate_proj.weight": "w_gate", "mlp.up_proj.weight": "w_up", "mlp.down_proj.weight": "w_down"}
_SHARED_UNREAD = ("self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.k_norm.weight")


def _top(cfg: Any) -> dict[str, tuple]:
    """The E2B/E4B models' per-layer input tensors outside the layers."""
    g, E = cfg.gemma4, cfg.hidden_size
    wide = g.ple_width * cfg.num_layers
    return {"model.embed_tokens_per_layer.weight": ("ple_embed", lambda w: w, (g.ple_vocab, wide)),
            "model.per_layer_model_projection.weight": ("ple_proj", lambda w: w.T, (wide, E)),
            "model.per_layer_projection_norm.weight": ("ple_norm", lambda w: w, (g.ple_width,))} if wide else {}


def gemma4_target(name: str, cfg: Any) -> Any:
    """Where a Gemma 4 tensor the key map's layer table cannot place goes (`keymap.hf_target`): the per-layer input
    tensors outside the layers; a layer that shares keys holds no key or value projection (None: read as nothing,
    where a checkpoint keeps one); with double-wide MLPs, each MLP tensor into the width every layer is held at (the
    other layers' half of the gate's and up's columns and the down's rows, left zero). False for any other tensor."""
    from jaxserve.loader.keymap import Target

    g = cfg.gemma4
    if name in _top(cfg):
        path, transform, shape = _top(cfg)[name]
        return Target(path, None, transform, shape)
    m = _LAYER_RE.match(name)
    if m is None:
        return False
    layer, rest = int(m.group(1)), m.group(2)
    shared = layer >= cfg.num_layers - g.shared_layers
    if shared and rest in _SHARED_UNREAD:
        return None
    if not g.double_wide or rest not in _MLP:
        return False
    E, F, dense = cfg.hidden_size, cfg.intermediate_size * (1 + shared), cfg.dense_layer(layer)
    path, row = ("dense_" * dense) + "layers." + _MLP[rest], cfg.stack_index(layer, dense)
    if rest == "mlp.down_proj.weight":
        return Target(path, row, lambda w: np.pad(w.T, ((0, cfg.intermediate_size * 2 - F), (0, 0))), (E, F))
    return Target(path, row, lambda w: w.T, (F, E), cols=(0, F))


def gemma4_names(cfg: Any, names: list[str]) -> list[str]:
    """The key map's names of a Gemma 4 checkpoint (`keymap.hf_names`) with the per-layer input tensors outside the
    layers, without the key and value projections of the layers that share keys."""
    first = cfg.num_layers - cfg.gemma4.shared_layers
    unread = {f"model.layers.{i}.{rest}" for i in range(first, cfg.num_layers) for rest in _SHARED_UNREAD}
    return [*_top(cfg), *(n for n in names if n not in unread)]


def gemma4_written(pairs: Iterator[tuple[str, np.ndarray]], cfg: Any) -> Iterator[tuple[str, np.ndarray]]:
    """A Gemma 4 checkpoint's (HF name, tensor) pairs as it stores them (`keymap.hf_tensors`): the experts packed,
    output-major, under its names; with double-wide MLPs, the other layers' down projections back to their width."""
    from jaxserve.loader.family_names import family_hf_name
    from jaxserve.loader.gpt_oss_keys import gpt_oss_packed

    first, F = cfg.num_layers - cfg.gemma4.shared_layers, cfg.intermediate_size
    for name, t in gpt_oss_packed(pairs, cfg):
        m = _LAYER_RE.match(name)
        if cfg.gemma4.double_wide and m and int(m.group(1)) < first and m.group(2) == "mlp.down_proj.weight":
            t = t[:, :F]
        yield family_hf_name(name, cfg), t
