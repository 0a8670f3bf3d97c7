"""OLMo Hybrid's checkpoint names (`config_olmo_hybrid`): its DeltaNet layers' q, k, v, gate (`g_proj`), b and a
projections into the one input projection's columns (`Params.mamba_layers.m_in`, in Qwen3.5's order), their
convolutions kept apart (`q_conv1d`, `k_conv1d`, `v_conv1d`: joined at load, split again when written), and its norms
by layer kind: a DeltaNet layer's before its mixer and its MLP (`attention_layer_norm`, `feedforward_layer_norm`), an
attention layer's after its attention and its MLP (`feedforward_layer_norm`, `post_feedforward_layernorm`).
transformers' names for the first two (`input_layernorm`, `post_attention_layernorm`) are read as well."""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np

from jaxserve.loader.qwen3_next_keys import gated_delta_targets

# The norms: (an attention layer's, a DeltaNet layer's) parameter; None: that kind has none.
OLMO_HYBRID_NORMS = {"attention_layer_norm.weight": (None, "layers.attn_norm"),
                     "feedforward_layer_norm.weight": ("layers.post_attn_norm", "layers.mlp_norm"),
                     "post_feedforward_layernorm.weight": ("layers.post_mlp_norm", None)}
_TRANSFORMERS_NAMES = {".input_layernorm.": ".attention_layer_norm.",
                       ".post_attention_layernorm.": ".feedforward_layer_norm."}
CONV_RE = re.compile(r"^(model\.layers\.\d+\.linear_attn\.)([qkv])_conv1d\.weight$")


def olmo_hybrid_name(name: str) -> str:
    """A norm's name as transformers holds it in memory (`input_layernorm`, `post_attention_layernorm`) as the
    checkpoints spell it; any other name as it is."""
    for theirs, ours in _TRANSFORMERS_NAMES.items():
        name = name.replace(theirs, ours)
    return name


def olmo_hybrid_targets(cfg) -> dict[str, tuple]:
    """A DeltaNet layer's tensor names (after `model.layers.{i}.`) to our parameters: (path, load transform,
    checkpoint shape[, the columns of the input projection it fills]); its convolution as one tensor
    (`linear_attn.conv1d.weight`: `joined_conv`)."""
    m, E = cfg.mamba, cfg.hidden_size
    t, at = {}, 0
    for name, width in (("q", m.n_groups * m.state_size), ("k", m.n_groups * m.state_size), ("v", m.inner),
                        ("g", m.inner), ("b", m.num_heads), ("a", m.num_heads)):
        t[f"linear_attn.{name}_proj.weight"] = ("mamba_layers.m_in", lambda w: w.T, (width, E), (at, at + width))
        at += width
    own = gated_delta_targets(cfg)
    return t | {name: own[name] for name in ("linear_attn.conv1d.weight", "linear_attn.dt_bias", "linear_attn.A_log")
                } | {"linear_attn.o_norm.weight": own["linear_attn.norm.weight"],
                     "linear_attn.o_proj.weight": own["linear_attn.out_proj.weight"]}


def joined_conv(held: dict[str, dict[str, np.ndarray]], name: str, tensor: np.ndarray
                ) -> tuple[str, np.ndarray] | None:
    """A layer's q, k and v convolutions, held in `held` as they come, as its one `linear_attn.conv1d.weight` once
    all three have (channels in that order, however the file divides them); None until then."""
    prefix, part = CONV_RE.match(name).groups()
    parts = held.setdefault(prefix, {})
    parts[part] = tensor
    if len(parts) < 3:
        return None
    del held[prefix]
    return f"{prefix}conv1d.weight", np.concatenate([parts[p] for p in "qkv"])


def split_conv(pairs: Iterator[tuple[str, np.ndarray]], cfg) -> Iterator[tuple[str, np.ndarray]]:
    """(name, tensor) pairs with each layer's convolution as its q, k and v ones (the inverse of `joined_conv`)."""
    m = cfg.mamba
    key = m.n_groups * m.state_size
    for name, t in pairs:
        if name.endswith(".linear_attn.conv1d.weight"):
            prefix = name.removesuffix("conv1d.weight")
            parts = np.split(t, [key, 2 * key])
            yield from ((f"{prefix}{p}_conv1d.weight", part) for p, part in zip("qkv", parts, strict=True))
        else:
            yield name, t
