"""Fused projections as the tensors they pack: Phi-3's `qkv_proj` (q, k, v rows) and `gate_up_proj` (gate, up rows),
and a GGUF Phi-2's biased `attn_qkv`."""

from __future__ import annotations

import re

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.errors import CheckpointError

FUSED_RE = re.compile(r"^(model\.layers\.\d+\.)(self_attn\.qkv_proj|mlp\.gate_up_proj)\.(weight|bias)$")


def unfused(name: str, tensor: np.ndarray, cfg: ModelConfig) -> list[tuple[str, np.ndarray]]:
    """A fused projection (Phi-3's `qkv_proj`: q, k, v rows; `gate_up_proj`: gate, up rows; a GGUF Phi-2's biased
    `attn_qkv`) as the tensors it packs, under their separate names; any other tensor as it is."""
    m = FUSED_RE.match(name)
    if m is None:
        return [(name, tensor)]
    prefix, kind, field = m.groups()
    if kind == "self_attn.qkv_proj":
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        names, cuts = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), (q, q + kv, q + 2 * kv)
    else:
        names, cuts = ("mlp.gate_proj", "mlp.up_proj"), (cfg.intermediate_size, 2 * cfg.intermediate_size)
    want = (cuts[-1], cfg.hidden_size)[:1 + (field == "weight")]
    if tuple(tensor.shape) != want:
        raise CheckpointError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {want} for this config")
    parts = np.split(tensor, cuts[:-1])
    return [(f"{prefix}{n}.{field}", part) for n, part in zip(names, parts, strict=True)]
