"""A Gated DeltaNet layer's checkpoint names (Qwen3-Next, Qwen3.5): its input projections into one matrix's columns
(`Params.mamba_layers.m_in`: q, k, v, then z, b, a), as Qwen3.5 names them (`linear_attn.in_proj_qkv`,
`in_proj_z`, `in_proj_b`, `in_proj_a`); Qwen3-Next's fused projections (`in_proj_qkvz`, `in_proj_ba`: each key
head's q, k, its value heads' v and z, then its value heads' b and a) are split into those at load and fused back."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import numpy as np

from jaxserve.errors import CheckpointError

QWEN3_NEXT_FUSED_RE = re.compile(r"^(model\.layers\.\d+\.linear_attn\.)in_proj_(qkvz|ba)\.weight$")


def gated_delta_targets(cfg) -> dict[str, tuple]:
    """A Gated DeltaNet layer's tensor names (after `model.layers.{i}.`) to our parameters: (path, load transform,
    checkpoint shape[, the columns of the input projection it fills])."""
    m, E = cfg.mamba, cfg.hidden_size
    ident: Callable[[np.ndarray], np.ndarray] = lambda w: w  # noqa: E731
    t = {}
    at = 0
    for name, width in (("qkv", m.conv_dim), ("z", m.inner), ("b", m.num_heads), ("a", m.num_heads)):
        t[f"linear_attn.in_proj_{name}.weight"] = ("mamba_layers.m_in", lambda w: w.T, (width, E), (at, at + width))
        at += width
    return t | {"linear_attn.conv1d.weight": ("mamba_layers.m_conv", lambda w: w[:, 0, :], (m.conv_dim, 1, m.conv_kernel)),
                "linear_attn.dt_bias": ("mamba_layers.m_dt_bias", ident, (m.num_heads,)),
                "linear_attn.A_log": ("mamba_layers.m_a_log", ident, (m.num_heads,)),
                "linear_attn.norm.weight": ("mamba_layers.m_norm", ident, (m.head_dim,)),
                "linear_attn.out_proj.weight": ("mamba_layers.m_out", lambda w: w.T, (E, m.inner))}


def _widths(cfg) -> tuple[int, int, int, int]:
    """Per key head: its q (and k) rows, its value heads' v (and z) rows, its value heads' b (and a) rows; and the
    key heads."""
    m = cfg.mamba
    r = m.num_heads // m.n_groups
    return m.state_size, r * m.head_dim, r, m.n_groups


def qwen3_next_split(name: str, tensor: np.ndarray, cfg) -> list[tuple[str, np.ndarray]]:
    """Qwen3-Next's `in_proj_qkvz` as Qwen3.5's `in_proj_qkv` and `in_proj_z`, its `in_proj_ba` as `in_proj_b` and
    `in_proj_a` (rows regrouped from per key head to per kind)."""
    prefix, kind = QWEN3_NEXT_FUSED_RE.match(name).groups()
    dk, dv, r, G = _widths(cfg)
    rows = G * (2 * dk + 2 * dv) if kind == "qkvz" else G * 2 * r
    if tensor.shape != (rows, cfg.hidden_size):
        raise CheckpointError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected ({rows}, "
                              f"{cfg.hidden_size}) for this config")
    t = tensor.reshape(G, -1, cfg.hidden_size)
    if kind == "ba":
        return [(f"{prefix}in_proj_b.weight", t[:, :r].reshape(-1, cfg.hidden_size)),
                (f"{prefix}in_proj_a.weight", t[:, r:].reshape(-1, cfg.hidden_size))]
    q, k, v, z = np.split(t, np.cumsum([dk, dk, dv]), axis=1)
    qkv = np.concatenate([x.reshape(-1, cfg.hidden_size) for x in (q, k, v)])
    return [(f"{prefix}in_proj_qkv.weight", qkv), (f"{prefix}in_proj_z.weight", z.reshape(-1, cfg.hidden_size))]


def qwen3_next_fused(pairs: Iterator[tuple[str, np.ndarray]], cfg) -> Iterator[tuple[str, np.ndarray]]:
    """(name, tensor) pairs with each layer's `in_proj_qkv` and `in_proj_z`, `in_proj_b` and `in_proj_a` fused back
    into Qwen3-Next's `in_proj_qkvz` and `in_proj_ba` (the inverse of `qwen3_next_split`)."""
    dk, _, r, G = _widths(cfg)
    held: dict[str, np.ndarray] = {}
    for name, t in pairs:
        m = re.match(r"^(model\.layers\.\d+\.linear_attn\.)in_proj_(qkv|z|b|a)\.weight$", name)
        if m is None:
            yield name, t
            continue
        held[m.group(2)] = t
        if m.group(2) == "z":
            qkv = held.pop("qkv")
            q, k, v = qkv[:G * dk], qkv[G * dk:2 * G * dk], qkv[2 * G * dk:]
            parts = [x.reshape(G, -1, t.shape[-1]) for x in (q, k, v, held.pop("z"))]
            yield f"{m.group(1)}in_proj_qkvz.weight", np.concatenate(parts, axis=1).reshape(-1, t.shape[-1])
        elif m.group(2) == "a":
            parts = [x.reshape(G, r, t.shape[-1]) for x in (held.pop("b"), held.pop("a"))]
            yield f"{m.group(1)}in_proj_ba.weight", np.concatenate(parts, axis=1).reshape(-1, t.shape[-1])
