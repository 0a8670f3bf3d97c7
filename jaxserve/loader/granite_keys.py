"""Granite MoE's and Granite 4.0's packed tensors: its experts fused in one tensor per kind and its shared MLP's gate
and up in one, split into the per-expert and per-projection names the key map reads (`keymap.split_packed`), and
fused back for `jaxserve convert` (`granite_fused`)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np

from jaxserve.config import GRANITE_SHARED_FAMILIES, ModelConfig
from jaxserve.errors import CheckpointError

# Granite MoE's experts, all in one tensor each: gate and up rows per expert, down, and its router.
GRANITE_MOE_RE = re.compile(r"^(model\.layers\.\d+\.block_sparse_moe\.)(input_linear|output_linear|router\.layer)"
                             r"\.weight$")


# Granite's shared MLP (a dense Granite 4.0 model's only MLP): gate and up rows in one tensor, then down.
GRANITE_SHARED_RE = re.compile(r"^(model\.layers\.\d+\.)shared_mlp\.(input_linear|output_linear)\.weight$")


def granite_shared(name: str, tensor: np.ndarray, cfg: ModelConfig) -> list[tuple[str, np.ndarray]]:
    """Granite's shared MLP tensors as a shared expert's (a MoE model's) or the MLP's (a dense one's) gate, up and
    down projections, checked against the config."""
    m = GRANITE_SHARED_RE.match(name)
    assert m is not None
    prefix, kind = m.groups()
    F = cfg.shared_expert_intermediate_size if cfg.num_experts else cfg.intermediate_size
    want = (2 * F, cfg.hidden_size) if kind == "input_linear" else (cfg.hidden_size, F)
    if tuple(tensor.shape) != want:
        raise CheckpointError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {want} for this config")
    mlp = f"{prefix}mlp.shared_expert." if cfg.num_experts else f"{prefix}mlp."
    if kind == "output_linear":
        return [(f"{mlp}down_proj.weight", tensor)]
    return [(f"{mlp}gate_proj.weight", tensor[:F]), (f"{mlp}up_proj.weight", tensor[F:])]


def granite_experts(name: str, tensor: np.ndarray, cfg: ModelConfig) -> list[tuple[str, np.ndarray]]:
    """Granite MoE's fused expert tensors as Mixtral's per-expert ones (`experts.{j}.w1/w3/w2`, the router
    `gate`), checked against the config."""
    m = GRANITE_MOE_RE.match(name)
    assert m is not None
    prefix, kind = m.groups()
    X, F, E = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    want = {"input_linear": (X, 2 * F, E), "output_linear": (X, E, F), "router.layer": (X, E)}[kind]
    if tuple(tensor.shape) != want:
        raise CheckpointError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {want} for this config")
    if kind == "router.layer":
        return [(f"{prefix}gate.weight", tensor)]
    if kind == "output_linear":
        return [(f"{prefix}experts.{j}.w2.weight", tensor[j]) for j in range(X)]
    return [(f"{prefix}experts.{j}.{w}.weight", part) for j in range(X)
            for w, part in (("w1", tensor[j, :F]), ("w3", tensor[j, F:]))]


_MIXTRAL_EXPERT_RE = re.compile(r"^(model\.layers\.\d+\.block_sparse_moe\.)(?:experts\.(\d+)\.(w[123])|gate)\.weight$")


_OUR_SHARED_RE = re.compile(r"^(model\.layers\.\d+\.)mlp\.(?:shared_expert\.)?(gate|up|down)_proj\.weight$")


def _granite_shared_fused(pairs: Iterator[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
    """Granite's shared MLP fused back (the inverse of `granite_shared`)."""
    gate = None
    for name, t in pairs:
        m = _OUR_SHARED_RE.match(name)
        if m is None:
            yield name, t
        elif m.group(2) == "gate":
            gate = t
        elif m.group(2) == "up":
            yield f"{m.group(1)}shared_mlp.input_linear.weight", np.concatenate([gate, t])
        else:
            yield f"{m.group(1)}shared_mlp.output_linear.weight", t


def granite_fused(pairs: Iterator[tuple[str, np.ndarray]], cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """A Granite MoE checkpoint's (HF name, tensor) pairs with its experts and shared MLP fused back (the inverse
    of `granite_experts` and `granite_shared`)."""
    if cfg.family in GRANITE_SHARED_FAMILIES:
        pairs = _granite_shared_fused(pairs)
    if not cfg.num_experts:
        yield from pairs
        return
    held: dict[tuple[int, str], np.ndarray] = {}
    for name, t in pairs:
        m = _MIXTRAL_EXPERT_RE.match(name)
        if m is None:
            yield name, t
            continue
        prefix, j, kind = m.groups()
        if j is None:
            yield f"{prefix}router.layer.weight", t
            continue
        held[(int(j), kind)] = t
        if len(held) == 3 * cfg.num_experts:  # the layer's every expert: its fused tensors
            X = range(cfg.num_experts)
            yield f"{prefix}input_linear.weight", np.stack([np.concatenate([held[(x, "w1")], held[(x, "w3")]]) for x in X])
            yield f"{prefix}output_linear.weight", np.stack([held[(x, "w2")] for x in X])
            held.clear()
