"""MiMo-V2-Flash checkpoints (`config_mimo`) as uniform layers, and back.

Its windowed layers hold twice the full layers' KV heads, and its values are narrower than its keys. jaxserve holds
every layer with the windowed layers' KV heads (a full layer's k and v rows of each head twice: each query group of
twice the size splits into two groups reading the same key, so the attention is the same) and values `head_dim`
wide (v rows padded with zeros, so each head's output past its values' width is zero, and the output projection's
inputs there zero too). `mimo_uniform` makes a checkpoint tensor so before the key map reads it; `mimo_written` undoes
it for a checkpoint written back.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.config_mimo import FAMILY, mimo_kv_repeat
from jaxserve.loader.family_names import family_hf_name

_PROJ_RE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([kvo])_proj\.weight$")


def _heads(cfg: ModelConfig, layer: int) -> int:
    """How many times this layer's KV heads are held (a full layer's twice beside windowed layers)."""
    return 1 if cfg.layer_types[layer] == "sliding_attention" else mimo_kv_repeat(cfg)


def mimo_uniform(name: str, tensor: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """A checkpoint tensor in the uniform layout: k_proj [KVH * D, E], v_proj [KVH * D, E] (rows of each head padded
    from `attention_value_dim` to D), o_proj [E, QH * D]; any other tensor as it is."""
    m = _PROJ_RE.match(name)
    if m is None:
        return tensor
    layer, kind = int(m.group(1)), m.group(2)
    D, Dv = cfg.head_dim, cfg.attention_value_dim or cfg.head_dim
    if kind == "o":  # [E, QH * Dv] -> [E, QH * D]
        E = tensor.shape[0]
        w = tensor.reshape(E, -1, Dv)
        return np.pad(w, ((0, 0), (0, 0), (0, D - Dv))).reshape(E, -1)
    width = D if kind == "k" else Dv
    w = np.repeat(tensor.reshape(-1, width, tensor.shape[-1]), _heads(cfg, layer), axis=0)
    return np.pad(w, ((0, 0), (0, D - width), (0, 0))).reshape(-1, tensor.shape[-1])


def mimo_adapter_matrix(module: str, which: str, layer: int, w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """A LoRA adapter's `which` ("A" or "B") matrix of `module` in `layer` in the layout its projection is held in: of
    MiMo-V2-Flash, k's and v's B rows as the projection's rows (a full layer's heads twice, values padded), o's A
    columns as o's inputs (padded), so each delta is the one the adapter gives, laid out as its projection's output
    or input; any other as it is."""
    if cfg.family == FAMILY and (module, which) in (("k_proj", "B"), ("v_proj", "B"), ("o_proj", "A")):
        return mimo_uniform(f"model.layers.{layer}.self_attn.{module}.weight", w, cfg)
    return w


def mimo_written(pairs: Iterable[tuple[str, np.ndarray]], cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """The inverse of `mimo_uniform` over a checkpoint's (name, tensor) pairs, under its own names."""
    D, Dv = cfg.head_dim, cfg.attention_value_dim or cfg.head_dim
    for name, t in pairs:
        name = family_hf_name(name, cfg)
        m = _PROJ_RE.match(name)
        if m is None:
            yield name, t
            continue
        layer, kind = int(m.group(1)), m.group(2)
        if kind == "o":
            yield name, t.reshape(t.shape[0], -1, D)[..., :Dv].reshape(t.shape[0], -1)
            continue
        w = t.reshape(-1, D, t.shape[-1])[::_heads(cfg, layer)]
        yield name, (w if kind == "k" else w[:, :Dv]).reshape(-1, t.shape[-1])
