"""gpt-oss's, Qwen3-VL-MoE's, Llama 4's and Mistral 4's packed expert tensors: each layer's experts in one tensor
per kind, input-major (`gate_up_proj` [X, E, 2 * Fe], `down_proj` [X, Fe, E]; transformers' own modules, and so
Mistral 4's, output-major), split into the per-expert names the key map reads (`keymap.split_packed`), and packed
back for `jaxserve convert` (`gpt_oss_packed`). gpt-oss interleaves the gate's and the up projection's columns and
has biases too; the others put the gate's columns first."""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.errors import CheckpointError

GPT_OSS_EXPERTS_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)(_bias)?$")


def gpt_oss_experts(name: str, tensor: np.ndarray, cfg: ModelConfig) -> list[tuple[str, np.ndarray]]:
    """One packed tensor as every expert's own (`experts.{j}.gate_proj.weight` [Fe, E], its `.bias` [Fe], ...),
    checked against the config: column 2i of gpt-oss's `gate_up_proj` is the gate's i-th, column 2i + 1 the up's;
    Qwen3-VL-MoE's first Fe columns are the gate's."""
    m = GPT_OSS_EXPERTS_RE.match(name)
    assert m is not None
    prefix, kind, bias = m.groups()
    X, F, E = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    want = {("gate_up_proj", None): (X, E, 2 * F), ("down_proj", None): (X, F, E),
            ("gate_up_proj", "_bias"): (X, 2 * F), ("down_proj", "_bias"): (X, E)}[kind, bias]
    if cfg.family != "gpt_oss" and tuple(tensor.shape) == (X, want[2], want[1]):  # as transformers saves it
        tensor = np.swapaxes(tensor, 1, 2)  # (output-major; the Hub's checkpoints are input-major)
    if tuple(tensor.shape) != want:
        raise CheckpointError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {want} for this config")
    part = "bias" if bias else "weight"
    out = []
    for j in range(X):
        t = tensor[j] if bias else tensor[j].T  # [out, in], as the per-expert tensors are stored
        if kind == "down_proj":
            out.append((f"{prefix}{j}.down_proj.{part}", t))
        else:
            gate, up = (t[0::2], t[1::2]) if cfg.family == "gpt_oss" else (t[:F], t[F:])
            out += [(f"{prefix}{j}.gate_proj.{part}", gate), (f"{prefix}{j}.up_proj.{part}", up)]
    return out


_ONE_EXPERT_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.(weight|bias)$")


def gpt_oss_packed(pairs: Iterator[tuple[str, np.ndarray]], cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """A gpt-oss or Qwen3-VL-MoE checkpoint's (HF name, tensor) pairs with each layer's per-expert tensors packed
    back (the inverse of `gpt_oss_experts`)."""
    parts = ("weight", "bias") if cfg.family == "gpt_oss" else ("weight",)
    major = (lambda t: np.swapaxes(t, 1, 2)) if cfg.family in ("mistral4", "gemma4") else (lambda t: t)  # (as
    # transformers' modules hold them, output-major: Mistral 4's, Gemma 4's)
    held: dict[tuple[str, int, str, str], np.ndarray] = {}
    for name, t in pairs:
        m = _ONE_EXPERT_RE.match(name)
        if m is None:
            yield name, t
            continue
        prefix, j, kind, part = m.groups()
        held[(prefix, int(j), kind, part)] = t
        if len(held) < 3 * len(parts) * cfg.num_experts:
            continue
        X = range(cfg.num_experts)
        for part in parts:  # (a weight transposed back to input-major; `.T` leaves a bias as it is)
            suffix = "_bias" if part == "bias" else ""
            gate_up = []
            for x in X:
                g, u = held[(prefix, x, "gate", part)].T, held[(prefix, x, "up", part)].T
                both = np.concatenate([g, u], axis=-1)
                if cfg.family == "gpt_oss":
                    both[..., 0::2], both[..., 1::2] = g, u
                gate_up.append(both)
            yield f"{prefix}gate_up_proj{suffix}", major(np.stack(gate_up))
            yield f"{prefix}down_proj{suffix}", major(np.stack([held[(prefix, x, "down", part)].T for x in X]))
        held.clear()
