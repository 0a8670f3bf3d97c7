"""The checkpoint tensors of GPT-2, GPTBigCode, GPT-NeoX, GPT-J, Falcon and MPT (`config_gpt2`), each family's
`Layout`: its own names for the embeddings, norms, projections and head; q, k and v in one tensor (GPT-2's, a
multi-query GPTBigCode's and MPT's one after another, a multi-head GPTBigCode's and GPT-NeoX's per head, Falcon's per
KV head: its group's queries, then its key and value); GPT-2's weights Conv1D's [in, out]. Read as the Llama-named
[out, in] tensors the key map reads, and written back as they were."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Layout:
    """A family's names: every tensor's under `top_prefix` (which checkpoints of the bare backbone leave out), a
    layer's under `layers` and its number; `modules` a layer's modules' (theirs: ours; the fused q/k/v one's `qkv`),
    `top` the tensors outside the layers (theirs: ours), `buffers` the tensors that carry no parameter."""

    top_prefix: str
    layers: str
    modules: dict[str, str]
    qkv: str
    top: dict[str, str]
    buffers: re.Pattern

    def layer_re(self) -> re.Pattern:
        alternatives = "|".join(re.escape(m) for m in (*self.modules, self.qkv) if m)
        return re.compile(rf"^(?:{re.escape(self.top_prefix)})?{re.escape(self.layers)}(\d+)\.({alternatives})\."
                          r"(weight|bias)$")


_GPT2 = Layout("transformer.", "h.", {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm",
                                     "attn.c_proj": "self_attn.o_proj", "mlp.c_fc": "mlp.up_proj",
                                     "mlp.c_proj": "mlp.down_proj"}, "attn.c_attn",
               {"wte.weight": "model.embed_tokens.weight", "wpe.weight": "model.embed_positions.weight",
                "ln_f.weight": "model.norm.weight", "ln_f.bias": "model.norm.bias"},
               re.compile(r"\.attn\.(masked_)?bias$"))  # (older checkpoints' causal masks)
_NEOX = Layout("gpt_neox.", "layers.", {"input_layernorm": "input_layernorm",
                                       "post_attention_layernorm": "post_attention_layernorm",
                                       "attention.dense": "self_attn.o_proj", "mlp.dense_h_to_4h": "mlp.up_proj",
                                       "mlp.dense_4h_to_h": "mlp.down_proj"}, "attention.query_key_value",
               {"embed_in.weight": "model.embed_tokens.weight", "final_layer_norm.weight": "model.norm.weight",
                "final_layer_norm.bias": "model.norm.bias"},
               re.compile(r"\.attention\.(masked_bias|bias|rotary_emb\.inv_freq)$"))
_GPTJ = Layout("transformer.", "h.", {"ln_1": "input_layernorm", "attn.out_proj": "self_attn.o_proj",
                                     "mlp.fc_in": "mlp.up_proj", "mlp.fc_out": "mlp.down_proj",
                                     **{f"attn.{p}": f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")}}, "",
               {"wte.weight": "model.embed_tokens.weight", "ln_f.weight": "model.norm.weight",
                "ln_f.bias": "model.norm.bias"}, _GPT2.buffers)  # (q, k and v apart)
_FALCON = Layout("transformer.", "h.", {"ln_attn": "input_layernorm", "ln_mlp": "post_attention_layernorm",
                                        "input_layernorm": "input_layernorm",  # (after: the names written back)
                                        "post_attention_layernorm": "post_attention_layernorm",
                                        "self_attention.dense": "self_attn.o_proj",
                                        "mlp.dense_h_to_4h": "mlp.up_proj", "mlp.dense_4h_to_h": "mlp.down_proj"},
                 "self_attention.query_key_value",
                 {"word_embeddings.weight": "model.embed_tokens.weight", "ln_f.weight": "model.norm.weight",
                  "ln_f.bias": "model.norm.bias"}, re.compile(r"\.rotary_emb\.inv_freq$"))
# (Falcon-40B's two norms of a parallel block, ours: theirs)
_FALCON_NORMS = {"input_layernorm": "ln_attn", "post_attention_layernorm": "ln_mlp"}
_MPT = Layout("transformer.", "blocks.", {"norm_1": "input_layernorm", "norm_2": "post_attention_layernorm",
                                         "attn.out_proj": "self_attn.o_proj", "ffn.up_proj": "mlp.up_proj",
                                         "ffn.down_proj": "mlp.down_proj"}, "attn.Wqkv",
               {"wte.weight": "model.embed_tokens.weight", "norm_f.weight": "model.norm.weight"}, re.compile("^$"))
_BLOOM = Layout("transformer.", "h.", {"input_layernorm": "input_layernorm",
                                       "post_attention_layernorm": "post_attention_layernorm",
                                       "self_attention.dense": "self_attn.o_proj", "mlp.dense_h_to_4h": "mlp.up_proj",
                                       "mlp.dense_4h_to_h": "mlp.down_proj"}, "self_attention.query_key_value",
                 {"word_embeddings.weight": "model.embed_tokens.weight", "ln_f.weight": "model.norm.weight",
                  "ln_f.bias": "model.norm.bias", "word_embeddings_layernorm.weight": "model.embed_norm.weight",
                  "word_embeddings_layernorm.bias": "model.embed_norm.bias"}, re.compile("^$"))
LAYOUTS = {"gpt2": _GPT2, "gpt_bigcode": _GPT2, "gpt_neox": _NEOX, "gptj": _GPTJ, "falcon": _FALCON, "mpt": _MPT,
           "bloom": _BLOOM}
_LAYER_RES = {family: layout.layer_re() for family, layout in LAYOUTS.items()}
_QKV = ("q_proj", "k_proj", "v_proj")
_OURS_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_HEAD = {"embed_out.weight": "lm_head.weight"}  # (GPT-NeoX's head)


def _grouped(cfg: Any) -> bool:
    """Whether the fused q/k/v tensor holds each KV head's group together, its queries' rows, then its key's and its
    value's (GPT-NeoX's and a multi-head GPTBigCode's: one query each; Falcon's); else all q, all k, all v."""
    return cfg.family in ("gpt_neox", "falcon", "bloom") or (cfg.family == "gpt_bigcode" and cfg.num_kv_heads > 1)


def _ungrouped(t: np.ndarray, cfg: Any) -> list[np.ndarray]:
    """A grouped fused q/k/v tensor's (or B's) rows as the q, k and v parts."""
    g, rest = cfg.num_heads // cfg.num_kv_heads, t.shape[1:]
    groups = t.reshape(cfg.num_kv_heads, g + 2, cfg.head_dim, *rest)
    return [groups[:, :g].reshape(-1, *rest), groups[:, g].reshape(-1, *rest), groups[:, g + 1].reshape(-1, *rest)]


def _conv1d(cfg: Any, module: str, field: str) -> bool:
    """Whether the family's tensor is a Conv1D weight, [in, out] (GPT-2's projections)."""
    return cfg.family == "gpt2" and field == "weight" and not module.startswith("ln_")


def own_tensors(name: str, tensor: np.ndarray, cfg: Any) -> list[tuple[str, np.ndarray]] | None:
    """A tensor of `cfg`'s family as the tensors it holds under the key map's names ([] for a buffer); None for a
    name of any other form (an untied head's `lm_head.weight`)."""
    layout = LAYOUTS[cfg.family]
    bare = name.removeprefix(layout.top_prefix)
    if bare in layout.top or name in _HEAD:
        return [(layout.top.get(bare) or _HEAD[name], tensor)]
    if layout.buffers.search(name):
        return []
    m = _LAYER_RES[cfg.family].match(name)
    if m is None:
        return None
    layer, module, field = m.groups()
    prefix = f"model.layers.{layer}."
    t = tensor.T if _conv1d(cfg, module, field) else tensor
    if module != layout.qkv:
        return [(f"{prefix}{layout.modules[module]}.{field}", t)]
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    parts = _ungrouped(t, cfg) if _grouped(cfg) else np.split(t, [q, q + kv])
    return [(f"{prefix}self_attn.{p}.{field}", part) for p, part in zip(_QKV, parts, strict=True)]


def own_top_names(cfg: Any) -> list[str]:
    """The key map's names of the tensors outside the layers that `cfg`'s family has beyond every family's (BLOOM's
    norm of the embeddings)."""
    top = LAYOUTS[cfg.family].top.values() if cfg.family in LAYOUTS else ()
    return [ours for ours in top if ours.startswith("model.embed_norm.")]


def own_written(pairs: Iterable[tuple[str, np.ndarray]], cfg: Any) -> Iterator[tuple[str, np.ndarray]]:
    """The key map's (name, [out, in] tensor) pairs as the family's checkpoint holds them (the inverse of
    `own_tensors`)."""
    layout = LAYOUTS[cfg.family]
    top = {ours: layout.top_prefix + theirs for theirs, ours in layout.top.items()}
    top |= {ours: theirs for theirs, ours in _HEAD.items()} if cfg.family == "gpt_neox" else {}
    modules = {ours: theirs for theirs, ours in layout.modules.items()}
    held: dict[tuple[str, str], dict[str, np.ndarray]] = {}
    for name, t in pairs:
        m = _OURS_RE.match(name)
        if m is None:  # (the embeddings, final norm and head)
            yield top.get(name, name), t
            continue
        layer, module, field = m.groups()
        prefix = f"{layout.top_prefix}{layout.layers}{layer}."
        if module.removeprefix("self_attn.") not in _QKV or not layout.qkv:
            theirs = _FALCON_NORMS[module] if cfg.family == "falcon" and cfg.parallel_norms == 2 \
                and module in _FALCON_NORMS else modules[module]
            yield f"{prefix}{theirs}.{field}", t.T if _conv1d(cfg, theirs, field) else t
            continue
        parts = held.setdefault((layer, field), {})
        parts[module.removeprefix("self_attn.")] = t
        if len(parts) == 3:
            rows = (cfg.num_kv_heads, -1, cfg.head_dim, *t.shape[1:])
            joined = np.concatenate([parts[p].reshape(rows) for p in _QKV], 1).reshape(-1, *t.shape[1:]) \
                if _grouped(cfg) else np.concatenate([parts[p] for p in _QKV])
            yield f"{prefix}{layout.qkv}.{field}", joined.T if _conv1d(cfg, layout.qkv, field) else joined


def own_adapter_key(name: str, cfg: Any) -> str:
    """A PEFT adapter tensor's name (`...transformer.h.0.attn.c_attn.lora_A.weight`) with a GPT-2's or GPTBigCode's
    attention modules under the names the adapter reader packs (`qkv_proj`) and reads (`o_proj`); its MLP's `c_fc`
    and `c_proj` it reads as up and down. Any other name as it is."""
    if cfg.family not in ("gpt2", "gpt_bigcode"):
        return name
    return name.replace(".attn.c_attn.", ".attn.qkv_proj.").replace(".attn.c_proj.", ".attn.o_proj.")


def qkv_adapter_rows(module: str, which: str, w: np.ndarray, cfg: Any) -> np.ndarray:
    """A fused q/k/v adapter's B (`qkv_proj`) with its rows all q, all k, all v: GPT-NeoX's, a multi-head
    GPTBigCode's and Falcon's hold each KV head's group together. Any other matrix as it is."""
    if (module, which) != ("qkv_proj", "B") or cfg.family not in LAYOUTS or not _grouped(cfg) \
            or len(w) != (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim:
        return w
    return np.concatenate(_ungrouped(w, cfg))
