"""Falcon-H1's multipliers (`config_falcon_h1.FalconScales`) folded into its weights at load and out again when
written: a projection's output scaled by m is the projection of weights (and bias) times m; its input scaled, the
weights alone. The mixer's input projection scales each of its parts (z, x, B, C, dt) by its own multiplier."""

from __future__ import annotations

import re

import numpy as np

_RE = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mamba\.(?:in|out)_proj|mlp\.(?:gate|down)_proj)"
                 r"\.(weight|bias)$")


def _scales(name: str, tensor: np.ndarray, cfg) -> np.ndarray | float | None:
    """What tensor `name` (our name) is multiplied by at load: a number, rows of numbers, or None."""
    m = _RE.match(name)
    if m is None:
        return None
    module, kind = m.groups()
    f, weight = cfg.falcon, kind == "weight"
    if module == "mamba.in_proj":  # (rows: z, x, B, C, dt)
        mb = cfg.mamba
        widths = (mb.inner, mb.inner, mb.n_groups * mb.state_size, mb.n_groups * mb.state_size, mb.num_heads)
        rows = np.repeat(np.asarray(f.ssm, np.float32), widths)
        return (rows * f.ssm_in if weight else rows).reshape(-1, *([1] * (tensor.ndim - 1)))
    into = f.attention_in if weight else 1.0  # (q, k, v read the input times attention_in)
    return {"self_attn.q_proj": into, "self_attn.k_proj": into * f.key, "self_attn.v_proj": into,
            "self_attn.o_proj": f.attention_out, "mamba.out_proj": f.ssm_out, "mlp.gate_proj": f.mlp[0],
            "mlp.down_proj": f.mlp[1]}[module]


def falcon_folded(name: str, tensor: np.ndarray, cfg) -> np.ndarray:
    """Tensor `name` with its multipliers folded in (in float32, then its own dtype)."""
    scale = _scales(name, tensor, cfg)
    if scale is None or np.all(np.asarray(scale) == 1.0):
        return tensor
    return (tensor.astype(np.float32) * scale).astype(tensor.dtype)


def falcon_unfolded(name: str, tensor: np.ndarray, cfg) -> np.ndarray:
    """Tensor `name` with its multipliers taken out again (the inverse of `falcon_folded`)."""
    scale = _scales(name, tensor, cfg)
    if scale is None or np.all(np.asarray(scale) == 1.0):
        return tensor
    return (tensor.astype(np.float32) / scale).astype(tensor.dtype)
