"""GPT-NeoX's checkpoint tensors (`config_gpt2.neox_config`): `gpt_neox.embed_in`, `layers.N.input_layernorm`,
`attention.query_key_value` (each head's q, k and v rows together), `attention.dense`, `post_attention_layernorm`,
`mlp.dense_h_to_4h`, `mlp.dense_4h_to_h`, `final_layer_norm`, and the head (`embed_out`); read as the Llama-named
tensors the key map reads, and written back as they were."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

_LAYER_RE = re.compile(r"^(?:gpt_neox\.)?layers\.(\d+)\.(input_layernorm|post_attention_layernorm|"
                       r"attention\.query_key_value|attention\.dense|mlp\.dense_h_to_4h|mlp\.dense_4h_to_h)\."
                       r"(weight|bias)$")
_TOP = {"gpt_neox.embed_in.weight": "model.embed_tokens.weight", "gpt_neox.final_layer_norm.weight":
        "model.norm.weight", "gpt_neox.final_layer_norm.bias": "model.norm.bias", "embed_out.weight": "lm_head.weight"}
_MODULES = {"input_layernorm": "input_layernorm", "post_attention_layernorm": "post_attention_layernorm",
            "attention.dense": "self_attn.o_proj", "mlp.dense_h_to_4h": "mlp.up_proj",
            "mlp.dense_4h_to_h": "mlp.down_proj"}
_QKV = ("q_proj", "k_proj", "v_proj")
_BUFFERS = re.compile(r"\.attention\.(masked_bias|bias|rotary_emb\.inv_freq)$")  # (older checkpoints': no parameter)
_OURS_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def neox_tensors(name: str, tensor: np.ndarray, cfg: Any) -> list[tuple[str, np.ndarray]] | None:
    """A GPT-NeoX tensor as the tensors it holds under the key map's names ([] for a buffer); None for a name of
    any other form."""
    if name in _TOP or f"gpt_neox.{name}" in _TOP:
        return [(_TOP.get(name) or _TOP[f"gpt_neox.{name}"], tensor)]
    if _BUFFERS.search(name):
        return []
    m = _LAYER_RE.match(name)
    if m is None:
        return None
    layer, module, field = m.groups()
    prefix = f"model.layers.{layer}."
    if module == "attention.query_key_value":  # (per head: its q, k and v rows)
        heads = tensor.reshape(cfg.num_heads, 3, cfg.head_dim, *tensor.shape[1:])
        return [(f"{prefix}self_attn.{p}.{field}", heads[:, i].reshape(-1, *tensor.shape[1:]))
                for i, p in enumerate(_QKV)]
    return [(f"{prefix}{_MODULES[module]}.{field}", tensor)]


def neox_written(pairs: Iterable[tuple[str, np.ndarray]], cfg: Any) -> Iterator[tuple[str, np.ndarray]]:
    """The key map's (name, tensor) pairs as GPT-NeoX's checkpoint holds them (the inverse of `neox_tensors`)."""
    top = {ours: theirs for theirs, ours in _TOP.items()}
    modules = {ours: theirs for theirs, ours in _MODULES.items()}
    held: dict[tuple[str, str], dict[str, np.ndarray]] = {}
    for name, t in pairs:
        m = _OURS_RE.match(name)
        if m is None:
            yield top.get(name, name), t
            continue
        layer, module, field = m.groups()
        prefix = f"gpt_neox.layers.{layer}."
        if module.removeprefix("self_attn.") in _QKV:
            parts = held.setdefault((layer, field), {})
            parts[module.removeprefix("self_attn.")] = t
            if len(parts) == 3:
                per_head = [parts[p].reshape(cfg.num_heads, 1, cfg.head_dim, *t.shape[1:]) for p in _QKV]
                joined = np.concatenate(per_head, 1).reshape(-1, *t.shape[1:])
                yield f"{prefix}attention.query_key_value.{field}", joined
            continue
        yield f"{prefix}{modules[module]}.{field}", t
