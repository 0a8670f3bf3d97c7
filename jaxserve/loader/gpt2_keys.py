"""GPT-2's and GPTBigCode's checkpoint tensors (`config_gpt2`): `transformer.wte`, `wpe`, `h.N.ln_1`, `attn.c_attn`
(q, k and v in one: GPT-2's and a multi-query GPTBigCode's one after another, a multi-head GPTBigCode's per head),
`attn.c_proj`, `ln_2`, `mlp.c_fc`, `mlp.c_proj`, `ln_f`, GPT-2's weights Conv1D's [in, out]; read as the Llama-named
[out, in] tensors the key map reads, and written back as they were."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

_LAYER_RE = re.compile(r"^(?:transformer\.)?h\.(\d+)\.(ln_1|ln_2|attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\."
                       r"(weight|bias)$")
_TOP = {"wte.weight": "model.embed_tokens.weight", "wpe.weight": "model.embed_positions.weight",
        "ln_f.weight": "model.norm.weight", "ln_f.bias": "model.norm.bias"}
_MODULES = {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm", "attn.c_proj": "self_attn.o_proj",
            "mlp.c_fc": "mlp.up_proj", "mlp.c_proj": "mlp.down_proj"}
_QKV = ("q_proj", "k_proj", "v_proj")
_BUFFERS = re.compile(r"\.attn\.(masked_)?bias$")  # (older checkpoints' causal masks: no parameter)
_OURS_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def _qkv_rows(cfg: Any) -> tuple[int, int]:
    """The rows of q and of each of k and v in `c_attn`."""
    return cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim


def gpt2_tensors(name: str, tensor: np.ndarray, cfg: Any) -> list[tuple[str, np.ndarray]] | None:
    """A GPT-2 tensor as the tensors it holds under the key map's names ([] for a mask buffer); None for a name of
    any other form (`lm_head.weight`)."""
    bare = name.removeprefix("transformer.")
    if bare in _TOP:
        return [(_TOP[bare], tensor)]
    if _BUFFERS.search(name):
        return []
    m = _LAYER_RE.match(name)
    if m is None:
        return None
    layer, module, field = m.groups()
    prefix = f"model.layers.{layer}."
    conv1d = cfg.family == "gpt2" and field == "weight" and not module.startswith("ln_")
    t = tensor.T if conv1d else tensor  # (Conv1D's [in, out])
    if module == "attn.c_attn":
        q, kv = _qkv_rows(cfg)
        if cfg.family == "gpt_bigcode" and cfg.num_kv_heads > 1:  # (per head: its q, k and v rows)
            heads = t.reshape(cfg.num_heads, 3, cfg.head_dim, *t.shape[1:])
            parts = [heads[:, i].reshape(q, *t.shape[1:]) for i in range(3)]
        else:
            parts = np.split(t, [q, q + kv])
        return [(f"{prefix}self_attn.{p}.{field}", part) for p, part in zip(_QKV, parts, strict=True)]
    return [(f"{prefix}{_MODULES[module]}.{field}", t)]


def gpt2_written(pairs: Iterable[tuple[str, np.ndarray]], cfg: Any) -> Iterator[tuple[str, np.ndarray]]:
    """The key map's (name, [out, in] tensor) pairs as GPT-2's checkpoint holds them (the inverse of
    `gpt2_tensors`): q, k and v joined into `c_attn`, Conv1D weights [in, out]."""
    top = {ours: f"transformer.{theirs}" for theirs, ours in _TOP.items()}
    modules = {ours: theirs for theirs, ours in _MODULES.items()}
    held: dict[tuple[str, str], dict[str, np.ndarray]] = {}
    for name, t in pairs:
        if name in top:
            yield top[name], t
            continue
        m = _OURS_RE.match(name)
        if m is None:  # (an untied head)
            yield name, t
            continue
        layer, module, field = m.groups()
        prefix = f"transformer.h.{layer}."
        if module.removeprefix("self_attn.") in _QKV:
            parts = held.setdefault((layer, field), {})
            parts[module.removeprefix("self_attn.")] = t
            if len(parts) == 3:
                if cfg.family == "gpt_bigcode" and cfg.num_kv_heads > 1:
                    per_head = [parts[p].reshape(cfg.num_heads, 1, cfg.head_dim, *t.shape[1:]) for p in _QKV]
                    joined = np.concatenate(per_head, axis=1).reshape(-1, *t.shape[1:])
                else:
                    joined = np.concatenate([parts[p] for p in _QKV])
                yield f"{prefix}attn.c_attn.{field}", joined.T if field == "weight" and cfg.family == "gpt2" else joined
            continue
        theirs = modules[module]
        conv1d = cfg.family == "gpt2" and field == "weight" and not theirs.startswith("ln_")
        yield f"{prefix}{theirs}.{field}", t.T if conv1d else t
