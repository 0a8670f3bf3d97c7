"""A hybrid model's checkpoint names: its Mamba (or short convolution) layers' tensors, its attention layers' apart
(`Params.mamba_layers`, `Params.attn_layers`), its MLPs apart where some layers have none or the first are dense
(`Params.mlp_layers`, `Params.dense_layers`); every layer's norms and MLP as other models' (`keymap`). Bamba's (and
Falcon-H1's), Nemotron-H's (`nemotron_keys`), LFM2's and OLMo Hybrid's (`olmo_hybrid_keys`) own names for the same
modules are read and written back here."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.config_mamba import apart_mlp_layers
from jaxserve.config_mamba_lm import MAMBA_LM_FAMILIES
from jaxserve.loader.falcon_keys import falcon_unfolded
from jaxserve.loader.nemotron_keys import nemotron_hf_name, nemotron_name
from jaxserve.loader.olmo_hybrid_keys import (
    OLMO_HYBRID_NORMS,
    olmo_hybrid_name,
    olmo_hybrid_targets,
    split_conv,
)
from jaxserve.loader.qwen3_next_keys import gated_delta_targets
from jaxserve.models.params import MLP_FIELDS


def mamba_targets(cfg: ModelConfig) -> dict[str, tuple[str, Callable[[np.ndarray], np.ndarray], tuple[int, ...]]]:
    """A Mamba layer's tensor names (after `model.layers.{i}.`) to our parameters, their load transform and their
    checkpoint shape."""
    m, E = cfg.mamba, cfg.hidden_size
    ident = lambda w: w  # noqa: E731
    if m.kind == "gated_delta":
        return olmo_hybrid_targets(cfg) if cfg.family == "olmo_hybrid" else gated_delta_targets(cfg)
    if m.kind == "mamba1":
        return mamba1_targets(cfg)
    t = {"mamba.in_proj.weight": ("mamba_layers.m_in", lambda w: w.T, (m.proj_dim, E)),
         "mamba.conv1d.weight": ("mamba_layers.m_conv", lambda w: w[:, 0, :], (m.conv_dim, 1, m.conv_kernel)),
         "mamba.out_proj.weight": ("mamba_layers.m_out", lambda w: w.T, (E, m.inner))}
    if m.kind == "mamba2":  # (a short convolution has no scan)
        t.update({"mamba.dt_bias": ("mamba_layers.m_dt_bias", ident, (m.num_heads,)),
                  "mamba.A_log": ("mamba_layers.m_a_log", ident, (m.num_heads,)),
                  "mamba.D": ("mamba_layers.m_d", ident, (m.num_heads,)),
                  **({"mamba.norm.weight": ("mamba_layers.m_norm", ident, (m.inner,))}
                     if m.gate_norm != "none" else {})})
    if m.conv_bias:
        t["mamba.conv1d.bias"] = ("mamba_layers.m_conv_b", ident, (m.conv_dim,))
    if m.proj_bias:
        t["mamba.in_proj.bias"] = ("mamba_layers.m_in_b", ident, (m.proj_dim,))
        t["mamba.out_proj.bias"] = ("mamba_layers.m_out_b", ident, (E,))
    return t


def mamba1_targets(cfg: ModelConfig) -> dict[str, tuple]:
    """A Jamba, Mamba or Falcon Mamba layer's tensor names (after `model.layers.{i}.`) to our parameters
    (`models.mamba1`)."""
    m, E = cfg.mamba, cfg.hidden_size
    C, R, N = m.inner, m.dt_rank, m.state_size
    ident, t = (lambda w: w), (lambda w: w.T)  # noqa: E731
    out = {"mamba.in_proj.weight": ("mamba_layers.m_in", t, (2 * C, E)),
           "mamba.conv1d.weight": ("mamba_layers.m_conv", lambda w: w[:, 0, :], (C, 1, m.conv_kernel)),
           "mamba.x_proj.weight": ("mamba_layers.m_x", t, (R + 2 * N, C)),
           "mamba.dt_proj.weight": ("mamba_layers.m_dt", t, (C, R)),
           "mamba.dt_proj.bias": ("mamba_layers.m_dt_bias", ident, (C,)),
           "mamba.A_log": ("mamba_layers.m_a_log", ident, (C, N)), "mamba.D": ("mamba_layers.m_d", ident, (C,)),
           "mamba.out_proj.weight": ("mamba_layers.m_out", t, (E, C))}
    if m.step_norms == "weighted":
        out |= {f"mamba.{name}_layernorm.weight": (f"mamba_layers.m_{name}_norm", ident, (size,))
                for name, size in (("dt", R), ("b", N), ("c", N))}
    if m.conv_bias:
        out["mamba.conv1d.bias"] = ("mamba_layers.m_conv_b", ident, (C,))
    if m.proj_bias:
        out |= {"mamba.in_proj.bias": ("mamba_layers.m_in_b", ident, (2 * C,)),
                "mamba.out_proj.bias": ("mamba_layers.m_out_b", ident, (E,))}
    return out


def hybrid_spec(cfg: ModelConfig, layer: int, rest: str, spec: tuple | None) -> tuple | None:
    """Where tensor `rest` of layer `layer` goes in a hybrid model: (path, load transform, checkpoint shape, index on
    its stack), given what other models make of it (`spec`: path, transform, shape; None: nothing); None where
    the layer holds no such tensor."""
    m = cfg.mamba
    field = None if spec is None else spec[0].removeprefix("layers.")
    if not _held(cfg, layer, rest):
        return None
    if cfg.family == "olmo_hybrid" and rest in OLMO_HYBRID_NORMS:
        path = OLMO_HYBRID_NORMS[rest][layer in m.layers]
        return None if path is None else (path, lambda w: w, (cfg.hidden_size,), layer)
    if layer in m.layers:
        if rest in mamba_targets(cfg):  # (path, transform, shape[, columns]): the index on the stack after the shape
            path, transform, shape, *cols = mamba_targets(cfg)[rest]
            return (path, transform, shape, m.layers.index(layer), *cols)
        if rest.startswith("self_attn.") and not m.parallel:
            return None
    if spec is None:
        return None
    at = lambda prefix, index: (prefix + spec[0], *spec[1:3], index, *spec[3:])  # noqa: E731 (columns after the index)
    if rest.startswith("self_attn."):
        return at("attn_", cfg.attention_layers.index(layer))
    if (m.no_mlp or cfg.num_dense_layers) and field in MLP_FIELDS:  # (the MLPs stacked apart)
        return at("dense_", cfg.stack_index(layer, True)) if cfg.num_experts and cfg.dense_layer(layer) else \
            at("mlp_", apart_mlp_layers(cfg).index(layer))
    return at("", layer)


def _held(cfg: ModelConfig, layer: int, rest: str) -> bool:
    """Whether layer `layer` holds other models' tensor `rest`: not the MLP's (and its norm's) of a mixer alone,
    nor the attention's and its input norm's of an MLP alone."""
    m = cfg.mamba
    if layer in m.no_mlp and rest.startswith(("mlp.", "post_attention_layernorm.")):
        return False
    return not (layer in m.no_mixer and rest.startswith(("self_attn.", "input_layernorm.")))


def hybrid_layer_names(cfg: ModelConfig, layer: int, names: list[str]) -> list[str]:
    """Layer `layer`'s tensor names (after `model.layers.{i}.`) given other models' `names`: a Mamba layer's
    mixer in attention's place (or beside it), none of a part the layer lacks."""
    names = [n for n in names if _held(cfg, layer, n)]
    if cfg.family == "olmo_hybrid":
        names = [n for n in names if olmo_hybrid_name("." + n)[1:] not in OLMO_HYBRID_NORMS] + [
            n for n, paths in OLMO_HYBRID_NORMS.items() if paths[layer in cfg.mamba.layers]]
    if layer not in cfg.mamba.layers:
        return names
    # (a Mamba layer beside attention, Falcon-H1's, keeps attention's tensors)
    return [n for n in names if cfg.mamba.parallel or not n.startswith("self_attn.")] + list(mamba_targets(cfg))


# Bamba's names for Llama's modules (its MLP "feed_forward", the norm before it "pre_ff_layernorm", the final norm
# "final_layernorm"), read as Llama's and written back as Bamba's.
_BAMBA_RE = re.compile(r"^(model\.layers\.\d+\.)(feed_forward\.|pre_ff_layernorm\.)")
_BAMBA_MODULES = {"feed_forward.": "mlp.", "pre_ff_layernorm.": "post_attention_layernorm."}


def bamba_name(name: str) -> str:
    """A Bamba tensor's Llama name; any other name as it is."""
    if name == "model.final_layernorm.weight":
        return "model.norm.weight"
    m = _BAMBA_RE.match(name)
    return m.group(1) + _BAMBA_MODULES[m.group(2)] + name[m.end():] if m else name


def bamba_hf_name(name: str) -> str:
    """A Llama tensor name as a Bamba checkpoint spells it (the inverse of `bamba_name`)."""
    if name == "model.norm.weight":
        return "model.final_layernorm.weight"
    m = re.match(r"^(model\.layers\.\d+\.)(mlp\.|post_attention_layernorm\.)", name)
    inverse = {v: k for k, v in _BAMBA_MODULES.items()}
    return m.group(1) + inverse[m.group(2)] + name[m.end():] if m else name


def hybrid_name(name: str, cfg: ModelConfig | None) -> str:
    """A Bamba, Nemotron-H, LFM2 or OLMo Hybrid tensor's name as a hybrid model's layer holds it (Nemotron-H's, LFM2's
    and OLMo Hybrid's by `cfg`: Nemotron-H's blocks paired into layers); other names as they are."""
    family = None if cfg is None else cfg.family
    return nemotron_name(name, cfg) if family in ("nemotron_h", *MAMBA_LM_FAMILIES) else \
        lfm2_name(name, lfm3=family == "lfm3") if family in ("lfm2", "lfm3") \
        else olmo_hybrid_name(name) if family == "olmo_hybrid" else bamba_name(name)


def hybrid_written(pairs: Iterator[tuple[str, np.ndarray]], cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """(name, tensor) pairs as the model's own checkpoints hold them (`hybrid_hf_name`; OLMo Hybrid's convolutions
    apart, Falcon-H1's multipliers out of its weights); any other model's as they are."""
    if cfg.family == "olmo_hybrid":
        pairs = split_conv(pairs, cfg)
    for name, t in pairs:
        yield hybrid_hf_name(name, cfg), falcon_unfolded(name, t, cfg) if cfg.family == "falcon_h1" else t


def hybrid_hf_name(name: str, cfg: ModelConfig) -> str:
    """The inverse of `hybrid_name`: a tensor name as the model's own checkpoints spell it."""
    if cfg.family in ("lfm2", "lfm3"):
        return lfm2_name(name, to_hf=True, lfm3=cfg.family == "lfm3")
    if cfg.family in MAMBA_LM_FAMILIES:  # (named as Nemotron-H's blocks)
        return nemotron_hf_name(name, cfg)
    return {"nemotron_h": nemotron_hf_name, "bamba": lambda n, _: bamba_hf_name(n),
            "falcon_h1": lambda n, _: bamba_hf_name(n), "jamba": lambda n, _: bamba_hf_name(n)}.get(
        cfg.family, lambda n, _: n)(name, cfg)


# LFM2's names for Llama's and the convolution's modules (after `model.layers.N.`; its final norm `embedding_norm`).
LFM2_NAMES = {"feed_forward.expert_bias": "mlp.gate.e_score_correction_bias", "feed_forward.experts.": "mlp.experts.",
              "feed_forward.gate.": "mlp.gate.", "operator_norm.": "input_layernorm.", "ffn_norm.": "post_attention_layernorm.",
              "feed_forward.w1.": "mlp.gate_proj.", "feed_forward.w3.": "mlp.up_proj.",
              "feed_forward.w2.": "mlp.down_proj.", "self_attn.out_proj.": "self_attn.o_proj.",
              "self_attn.q_layernorm.": "self_attn.q_norm.", "self_attn.k_layernorm.": "self_attn.k_norm.",
              "conv.in_proj.": "mamba.in_proj.", "conv.conv.": "mamba.conv1d.", "conv.out_proj.": "mamba.out_proj."}


# LFM3's norms: Gemma's four names (its attention's modules already Llama's).
LFM3_NAMES = {**{k: v for k, v in LFM2_NAMES.items() if not k.startswith("self_attn.")},
              "ffn_norm.": "pre_feedforward_layernorm.", "post_operator_norm.": "post_attention_layernorm.",
              "post_ffn_norm.": "post_feedforward_layernorm."}


def lfm2_name(name: str, to_hf: bool = False, lfm3: bool = False) -> str:
    """An LFM2 (`lfm3`: LFM3) tensor's name as a hybrid model's layer holds it (Llama's and the Mamba layers'
    names), or back (`to_hf`); other names as they are."""
    top, modules = {"model.embedding_norm.weight": "model.norm.weight"}, LFM3_NAMES if lfm3 else LFM2_NAMES
    if to_hf:
        top, modules = {v: k for k, v in top.items()}, {v: k for k, v in modules.items()}
    if name in top:
        return top[name]
    m = re.match(r"^(model\.layers\.\d+\.)(.+)$", name)
    old = next((k for k in modules if m and m.group(2).startswith(k)), None)
    if old is None:
        return name
    name = m.group(1) + modules[old] + m.group(2)[len(old):]
    experts = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # (LFM2-MoE's experts)
    experts = {v: k for k, v in experts.items()} if to_hf else experts
    return re.sub(r"(\.experts\.\d+\.)(\w+)(\.weight)$", lambda e: e.group(1) + experts.get(e.group(2), e.group(2))
                  + e.group(3), name)


def hybrid_adapter_key(name: str, cfg: ModelConfig) -> str:
    """A PEFT adapter's tensor of a Bamba, Nemotron-H or LFM2 model (`base_model.model.backbone.layers.{block}.mixer.
    q_proj.lora_A.weight`, `...feed_forward.w1.lora_A.weight`) under its hybrid layer's module name
    (`model.layers.{layer}.self_attn.q_proj.lora_A.weight`, `...mlp.gate_proj...`)."""
    body, sep, tail = name.removeprefix("base_model.model.").partition(".lora_")
    return hybrid_name(body + ".weight", cfg).removesuffix(".weight") + sep + tail if sep else name
