"""Nemotron-H checkpoints' names (`backbone.layers.{block}.mixer.*`, `backbone.layers.{block}.norm`): each block's
tensors under the layer it is part of (`config_nemotron.pair_blocks`), named as a hybrid model's (`mamba_keys`), and
written back under the blocks' names."""

from __future__ import annotations

import functools
import re

from jaxserve.config import ModelConfig

_BLOCK_RE = re.compile(r"^(?:backbone|model)\.layers\.(\d+)\.(norm|mixer)\.(.+)$")
_TOP = {"embeddings.weight": "model.embed_tokens.weight", "norm_f.weight": "model.norm.weight"}


@functools.lru_cache(maxsize=8)
def _blocks(cfg: ModelConfig) -> tuple[tuple[int, str], ...]:
    """Per block: (its layer, "mamba", "attention" or "mlp")."""
    m, out = cfg.mamba, []
    for i in range(cfg.num_layers):
        if i not in m.no_mixer:
            out.append((i, "mamba" if i in m.layers else "attention"))
        if i not in m.no_mlp:
            out.append((i, "mlp"))
    return tuple(out)


def nemotron_name(name: str, cfg: ModelConfig) -> str:
    """A Nemotron-H tensor's name as a hybrid model's layer holds it (`model.layers.{layer}.mamba.in_proj.weight`,
    `.self_attn.q_proj.weight`, `.mlp.up_proj.weight`, `.input_layernorm.weight`, ...); other names as they are."""
    prefix, _, rest = name.partition(".")
    if prefix in ("backbone", "model") and rest in _TOP:
        return _TOP[rest]
    m = _BLOCK_RE.match(name)
    blocks = _blocks(cfg)
    if not m or int(m.group(1)) >= len(blocks):
        return name
    layer, kind = blocks[int(m.group(1))]
    if m.group(2) == "norm":
        module = "post_attention_layernorm." if kind == "mlp" else "input_layernorm."
        return f"model.layers.{layer}.{module}{m.group(3)}"
    module = {"mamba": "mamba.", "attention": "self_attn.", "mlp": "mlp."}[kind]
    return f"model.layers.{layer}.{module}{m.group(3)}"


def nemotron_hf_name(name: str, cfg: ModelConfig) -> str:
    """A hybrid model's tensor name as a Nemotron-H checkpoint spells it (the inverse of `nemotron_name`)."""
    top = {v: k for k, v in _TOP.items()}
    if name in top:
        return "backbone." + top[name]
    m = re.match(r"^model\.layers\.(\d+)\.(input_layernorm|post_attention_layernorm|mamba|self_attn|mlp)\.(.+)$", name)
    if not m:
        return name
    layer, module, rest = int(m.group(1)), m.group(2), m.group(3)
    kinds = {"input_layernorm": ("mamba", "attention"), "post_attention_layernorm": ("mlp",), "mamba": ("mamba",),
             "self_attn": ("attention",), "mlp": ("mlp",)}[module]
    block = next(b for b, (i, kind) in enumerate(_blocks(cfg)) if i == layer and kind in kinds)
    return f"backbone.layers.{block}.{'norm' if module.endswith('layernorm') else 'mixer'}.{rest}"

