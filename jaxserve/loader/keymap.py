"""The explicit map from checkpoint tensor names to jaxserve parameters.

HF names are canonical; GGUF names are translated to them first. Every tensor is checked
against the parameter declaration: unknown, missing, duplicated or misshapen tensors are
refused with a message that names them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from jaxserve.config import (
    GEMMA_FAMILIES,
    GLM_FAMILIES,
    GRANITE_MOE_FAMILIES,
    GRANITE_SHARED_FAMILIES,
    INTERLEAVED_ROPE_FAMILIES,
    ModelConfig,
)
from jaxserve.config_families import HEAD_BIAS_FAMILIES, LEARNED_POSITION_FAMILIES, WEIGHTLESS_NORM_FAMILIES
from jaxserve.config_mla import DSA_FAMILIES, MLA_FAMILIES
from jaxserve.errors import CheckpointError
from jaxserve.loader.exaone_keys import exaone_name
from jaxserve.loader.family_names import family_hf_name, family_name, router_bias_name
from jaxserve.loader.fused_keys import FUSED_RE, unfused
from jaxserve.loader.gemma4_keys import gemma4_names, gemma4_target, gemma4_targets, gemma4_written
from jaxserve.loader.gpt2_keys import LAYOUTS, own_top_names, own_written
from jaxserve.loader.gpt_oss_keys import GPT_OSS_EXPERTS_RE, gpt_oss_experts, gpt_oss_packed
from jaxserve.loader.granite_keys import (
    GRANITE_MOE_RE,
    GRANITE_SHARED_RE,
    granite_experts,
    granite_fused,
    granite_shared,
)
from jaxserve.loader.mamba_keys import hybrid_layer_names, hybrid_name, hybrid_spec, hybrid_written
from jaxserve.loader.mimo_keys import mimo_written
from jaxserve.loader.mla_keys import KV_B_RE, MLA_FIELDS, mla_fused, mla_hf_tensor, mla_targets, split_kv_b
from jaxserve.loader.qwen3_next_keys import QWEN3_NEXT_FUSED_RE, qwen3_next_fused, qwen3_next_split


@dataclass(frozen=True)
class Target:
    path: str  # e.g. "layers.wq"
    layer: int | None  # index on the stacked layer axis
    transform: Callable[[np.ndarray], np.ndarray]
    hf_shape: tuple[int, ...]
    expert: int | None = None  # index on the axis after the layers' (an expert's tensors; an xIELU parameter)
    cols: tuple[int, int] | None = None  # the part of the last axis it fills (a Gated DeltaNet's input projections)


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^(block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+\.(?:weight|bias))$")

# Names some checkpoints carry that hold no parameter of ours: RoPE tables, a classification model's score head (read apart
# by `jaxserve.engine.classifier`), ERNIE 4.5's and Qwen3-Next's multi-token prediction modules (`model.mtp*`, `mtp.*`:
# read apart, by `models.mtp`; MiMo-V2-Flash's not read), the vision tower of an image-text model served as text.
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$|^score\.(weight|bias)$|^model\.mtp[._]|^mtp\."
                      r"|^(model\.)?(vision_tower\.|vision_model\.|multi_modal_projector\.|mm_projector\.|connector\.|image_newline$"
                      r"|visual\.|embed_vision\.|audio_tower\.|embed_audio\.)")


def _layer_targets(cfg: ModelConfig, dense: bool = False) -> dict[str, tuple]:
    """A layer's tensor names (after `model.layers.{i}.`) to our parameters (the MoE layers' of a MoE model; with
    `dense`, its dense first layers' (Gemma 4's full-attention ones), whose paths `hf_target` moves to `dense_layers`)."""
    cfg = cfg.kind_config(not dense)  # (Gemma 4's full-attention layers attend with their own widths)
    E, F, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    Hq, Hkv, Dq = cfg.num_heads, cfg.num_kv_heads, cfg.q_head_dim

    def proj_in(heads: int, D: int = D) -> Callable[[np.ndarray], np.ndarray]:
        return lambda w: w.T.reshape(E, heads, D)

    def bias(heads: int, D: int = D) -> Callable[[np.ndarray], np.ndarray]:
        return lambda b: b.reshape(heads, D)

    ident = lambda w: w  # noqa: E731
    t: dict[str, tuple[str, Callable[[np.ndarray], np.ndarray], tuple[int, ...]]] = {
        "input_layernorm.weight": ("layers.attn_norm", ident, (E,)),
        "self_attn.q_proj.weight": ("layers.wq", proj_in(Hq, Dq), (Hq * Dq, E)),
        "self_attn.k_proj.weight": ("layers.wk", proj_in(Hkv), (Hkv * D, E)),
        "self_attn.v_proj.weight": ("layers.wv", proj_in(Hkv), (Hkv * D, E)),
        "self_attn.o_proj.weight": ("layers.wo", lambda w: w.T.reshape(Hq, D, E), (E, Hq * D)),
        "post_attention_layernorm.weight": ("layers.mlp_norm", ident, (E,)),
    }
    if not cfg.mlp_own_norm:  # Cohere: the MLP reads the attention's normed input
        del t["post_attention_layernorm.weight"]
    if not cfg.input_norms:  # OLMo 2: a norm after each of attention and the MLP, none before
        del t["input_layernorm.weight"]
        t["post_attention_layernorm.weight"] = ("layers.post_attn_norm", ident, (E,))
        t["post_feedforward_layernorm.weight"] = ("layers.post_mlp_norm", ident, (E,))
    if cfg.output_norms and cfg.family in (*GEMMA_FAMILIES, "afmoe", "lfm3"):  # a norm before and after each of both
        t["post_attention_layernorm.weight"] = ("layers.post_attn_norm", ident, (E,))
        t["pre_feedforward_layernorm.weight"] = ("layers.mlp_norm", ident, (E,))
        t["post_feedforward_layernorm.weight"] = ("layers.post_mlp_norm", ident, (E,))
    if cfg.num_experts and not dense and cfg.gemma4 is None:
        X, Fs = cfg.num_experts, cfg.shared_expert_intermediate_size
        moe = _moe_module(cfg)
        router = f"{moe}.router" if cfg.family in ("gpt_oss", "jamba") else f"{moe}.gate"
        t[f"{router}.weight"] = ("layers.router", lambda w: w.T, (X, E))
        if cfg.moe_latent_size:  # (Nemotron 3 Super's latent MoE)
            t["mlp.fc1_latent_proj.weight"] = ("layers.we_latent_in", lambda w: w.T, (cfg.moe_latent_size, E))
            t["mlp.fc2_latent_proj.weight"] = ("layers.we_latent_out", lambda w: w.T, (E, cfg.moe_latent_size))
        if cfg.family == "gpt_oss":
            t[f"{router}.bias"] = ("layers.b_router", ident, (X,))
        if cfg.router_bias:  # ERNIE's as [1, X]; MiniMax-M2's beside its gate
            ernie = cfg.family == "ernie4_5_moe"
            t[f"{moe}.{router_bias_name(cfg.family)}"] = (
                "layers.router_bias", lambda b: b.reshape(-1), (1, X) if ernie else (X,))
        if Fs:
            shared = "mlp.shared_experts" if cfg.family in ("glm4_moe", "ernie4_5_moe", "dots1", "nemotron_h", "exaone_moe",
                                                            "afmoe", "cohere2_moe", *MLA_FAMILIES) else "mlp.shared_expert"
            t[f"{shared}.gate_proj.weight"] = ("layers.ws_gate", lambda w: w.T, (Fs, E))
            t[f"{shared}.up_proj.weight"] = ("layers.ws_up", lambda w: w.T, (Fs, E))
            t[f"{shared}.down_proj.weight"] = ("layers.ws_down", lambda w: w.T, (E, Fs))
            if cfg.shared_expert_gated:
                t["mlp.shared_expert_gate.weight"] = ("layers.ws_mix", lambda w: w.reshape(E), (1, E))
    else:
        t["mlp.gate_proj.weight"] = ("layers.w_gate", lambda w: w.T, (F, E))
        t["mlp.up_proj.weight"] = ("layers.w_up", lambda w: w.T, (F, E))
        t["mlp.down_proj.weight"] = ("layers.w_down", lambda w: w.T, (E, F))
    if cfg.attention_bias:
        t["self_attn.q_proj.bias"] = ("layers.bq", bias(Hq, Dq), (Hq * Dq,))
        t["self_attn.k_proj.bias"] = ("layers.bk", bias(Hkv), (Hkv * D,))
        t["self_attn.v_proj.bias"] = ("layers.bv", bias(Hkv), (Hkv * D,))
        t |= {"self_attn.o_proj.bias": ("layers.bo", ident, (E,))} if cfg.output_bias else {}
    if cfg.qk_norm and cfg.qk_norm_heads:  # one weight per head and dim
        t["self_attn.q_norm.weight"] = ("layers.q_norm", lambda w: w.reshape(Hq, D), (Hq * D,))
        t["self_attn.k_norm.weight"] = ("layers.k_norm", lambda w: w.reshape(Hkv, D), (Hkv * D,))
    elif cfg.qk_norm and cfg.qk_norm_weights_per_head and cfg.family != "stablelm":  # Cohere's, rotary order below
        order = _halfsplit_order(D, cfg.rotary_dims)
        t["self_attn.q_norm.weight"] = ("layers.q_norm", lambda w: w[:, order], (Hq, D))
        t["self_attn.k_norm.weight"] = ("layers.k_norm", lambda w: w[:, order], (Hkv, D))
    elif cfg.qk_norm and cfg.family != "stablelm":  # (StableLM 2 12B's, a tensor a head: `_STABLELM_NORM`)
        t["self_attn.q_norm.weight"] = ("layers.q_norm", ident, (D,))
        t["self_attn.k_norm.weight"] = ("layers.k_norm", ident, (D,))
        if cfg.family == "phi":  # (`q_layernorm`, `k_layernorm`: LayerNorms with biases)
            t |= {f"self_attn.{x}_norm.bias": (f"layers.{x}_norm_b", ident, (D,)) for x in "qk"}
    if not cfg.gated_mlp:  # Arcee's, Apertus' and Nemotron-H's MLP (and shared expert): up, an activation, down
        t = {k: v for k, v in t.items() if k not in ("mlp.gate_proj.weight", "mlp.shared_experts.gate_proj.weight")}
    if cfg.family == "apertus":  # its norms' names
        t["attention_layernorm.weight"] = t.pop("input_layernorm.weight")
        t["feedforward_layernorm.weight"] = t.pop("post_attention_layernorm.weight")
    if cfg.mlp_bias:  # (and a gated MLP's gate)
        t |= {"mlp.gate_proj.bias": ("layers.b_gate", ident, (F,))} if cfg.gated_mlp else {}
        t |= {"mlp.up_proj.bias": ("layers.b_up", ident, (F,)), "mlp.down_proj.bias": ("layers.b_down", ident, (E,))}
    if cfg.norm_bias:  # (Jais 2's LayerNorms; Phi's one)
        t |= {f"{n}.bias": (f"layers.{p}_b", ident, (E,)) for n, p in (("input_layernorm", "attn_norm"), (
            "post_attention_layernorm", "mlp_norm")) if f"{n}.weight" in t}
    if cfg.family in INTERLEAVED_ROPE_FAMILIES:  # q and k rows (and biases) with interleaved rotary pairs, read half-split
        for name in ("q_proj", "k_proj"):
            for kind in ("weight", "bias") if cfg.attention_bias else ("weight",):
                path, read, shape = t[f"self_attn.{name}.{kind}"]
                t[f"self_attn.{name}.{kind}"] = (path, lambda w, read=read: read(halfsplit_rows(w, cfg)), shape)
    if cfg.family == "glm4":  # a norm of the attention's and of the MLP's outputs
        t |= {"post_self_attn_layernorm.weight": ("layers.post_attn_norm", ident, (E,)),
              "post_mlp_layernorm.weight": ("layers.post_mlp_norm", ident, (E,))}
    if cfg.attention_sinks:
        t["self_attn.sinks"] = ("layers.sinks", ident, (Hq,))
    if cfg.family in ("afmoe", "lfm3"):  # the output gate's own projection, read beside each head's query (`wq`)
        G = cfg.attn_gate_width  # (LFM3's `g_proj` is `gate_proj` in its checkpoints)
        t["self_attn.q_proj.weight"] = ("layers.wq", proj_in(Hq), (Hq * D, E), (0, D))
        t["self_attn.gate_proj.weight"] = ("layers.wq", proj_in(Hq, G), (Hq * G, E), (D, D + G))
    if cfg.kv_cache_scales:  # scalars; stored as [] or [1]
        t |= {f"self_attn.{k}_scale": (f"layers.{k}_scale", lambda s: s.reshape(()), ()) for k in "kv"}
    if cfg.kv_lora_rank:  # DeepSeek's latent attention in place of q, k, v
        t = {name: spec for name, spec in t.items() if not name.startswith("self_attn.")} | mla_targets(cfg)
    return t if cfg.gemma4 is None else gemma4_targets(cfg, t)


def _halfsplit_order(head_dim: int, rotary: int) -> np.ndarray:
    """The order that turns a head's dims with interleaved rotary pairs (GLM's: dims 2i and 2i + 1 turn together)
    into the half-split order the model rotates (dims i and i + rotary / 2); the dims past `rotary` stay."""
    return np.concatenate([np.arange(0, rotary, 2), np.arange(1, rotary, 2), np.arange(rotary, head_dim)])


def halfsplit_rows(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """A q or k projection's tensor of GLM's ([heads * head_dim, ...]: weight, bias, a LoRA B) with each head's
    rows in the half-split rotary order (the dot products of q and k are unchanged)."""
    D = cfg.head_dim
    return w.reshape(-1, D, *w.shape[1:])[:, _halfsplit_order(D, cfg.rotary_dims)].reshape(w.shape)


KV_SCALE_PATHS = ("layers.k_scale", "layers.v_scale", "dense_layers.k_scale", "dense_layers.v_scale")
"""Parameters kept in float32 whatever the model's dtype."""


def _expert_targets(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Per-expert MLP tensor names (after `...experts.{j}.`) to our stacked parameters; HF layout [out, in]."""
    E, Fe = cfg.expert_width, cfg.moe_intermediate_size
    if _moe_module(cfg) == "block_sparse_moe":
        return {"w1.weight": ("layers.we_gate", (Fe, E)), "w3.weight": ("layers.we_up", (Fe, E)),
                "w2.weight": ("layers.we_down", (E, Fe))}
    t = {"gate_proj.weight": ("layers.we_gate", (Fe, E)), "up_proj.weight": ("layers.we_up", (Fe, E)),
         "down_proj.weight": ("layers.we_down", (E, Fe))}
    if not cfg.gated_mlp:  # (Nemotron 3's: up, a squared ReLU, down)
        del t["gate_proj.weight"]
    if cfg.swiglu_limit is not None:  # gpt-oss's experts are biased (read from its packed tensors: `gpt_oss_keys`)
        t.update({"gate_proj.bias": ("layers.be_gate", (Fe,)), "up_proj.bias": ("layers.be_up", (Fe,)),
                  "down_proj.bias": ("layers.be_down", (E,))})
    return t


# Apertus' xIELU parameters (after `model.layers.{i}.`): their column of `layers.xielu` and their shape.
_XIELU = {"mlp.act_fn.alpha_p": (0, (1,)), "mlp.act_fn.alpha_n": (1, (1,)), "mlp.act_fn.beta": (2, ()),
          "mlp.act_fn.eps": (3, ())}
# StableLM 2 12B's q and k norms (after `model.layers.{i}.`): one LayerNorm a head, on `layers.q_norm` [L, H, D].
_STABLELM_NORM = re.compile(r"^self_attn\.([qk])_layernorm\.norms\.(\d+)\.weight$")

_BACKBONE_RE = re.compile(r"^(embed_tokens|norm|final_layernorm|layers)\.")
# An image-text model's language model (Gemma 3's `language_model.model.*`, or `model.language_model.*`).
_LANGUAGE_MODEL_RE = re.compile(r"^(language_model\.(?=model\.|lm_head\.)|model\.language_model\.|model\.text_model\.)")

_PACKED_EXPERTS = ("gpt_oss", "qwen3_moe", "qwen3_5", "llama4", "mistral4", "gemma4")  # (each kind in one tensor)


def _moe_module(cfg: ModelConfig) -> str:
    """The name of a layer's MoE module: Mixtral's and Granite's `block_sparse_moe`, Qwen's `mlp`."""
    return "block_sparse_moe" if cfg.family in ("mixtral", "minimax_m2", *GRANITE_MOE_FAMILIES) else "mlp"


def split_packed(name: str, tensor: np.ndarray, cfg: ModelConfig) -> list[tuple[str, np.ndarray]] | None:
    """A tensor that packs several of ours (fused projections, Granite MoE's experts) as the tensors it packs,
    under their own names; None for any other."""
    if FUSED_RE.match(name):
        return unfused(name, tensor, cfg)
    if cfg.family in GRANITE_MOE_FAMILIES and GRANITE_MOE_RE.match(name):
        return granite_experts(name, tensor, cfg)
    if cfg.family in GRANITE_SHARED_FAMILIES and GRANITE_SHARED_RE.match(name):
        return granite_shared(name, tensor, cfg)
    if cfg.family in _PACKED_EXPERTS and GPT_OSS_EXPERTS_RE.match(name):  # (gpt-oss's, Qwen3-VL-MoE's, Qwen3.5-MoE's)
        return gpt_oss_experts(name, tensor, cfg)
    if cfg.kv_lora_rank and KV_B_RE.match(name):
        return split_kv_b(name, tensor, cfg)
    if cfg.family == "qwen3_next" and QWEN3_NEXT_FUSED_RE.match(name):
        return qwen3_next_split(name, tensor, cfg)
    return None


def canonical_name(name: str, cfg: ModelConfig | None = None) -> str:
    """A tensor name as a `*ForCausalLM` checkpoint spells it: checkpoints saved from the bare backbone
    (`AutoModel`, as embedding models such as Qwen3-Embedding ship) drop the `model.` prefix; an image-text
    model nests its language model under `language_model`; EXAONE 3, Bamba, Nemotron-H (`cfg`) rename modules."""
    if name.startswith("transformer."):
        return exaone_name(name)
    m = _LANGUAGE_MODEL_RE.match(name)
    if m:
        name = name[m.end():] if m.group(1).startswith("language_model") else "model." + name[m.end():]
    return family_name(hybrid_name("model." + name if _BACKBONE_RE.match(name) else name, cfg), cfg)


def hf_target(name: str, cfg: ModelConfig) -> Target | None:
    """Where HF tensor `name` goes; None for names that carry no parameter (e.g. inv_freq)."""
    if _IGNORED.search(name):
        return None
    if cfg.gemma4 is not None and (own := gemma4_target(name, cfg)) is not False:
        return own
    E, V, learned = cfg.hidden_size, cfg.vocab_size, cfg.family in LEARNED_POSITION_FAMILIES
    top = {"model.embed_tokens.weight": ("embed", (V, E)), "model.norm.weight": ("final_norm", (E,)),
           "lm_head.weight": ("lm_head", (V, E)), "model.norm.bias": ("final_norm_b", (E,)) if cfg.norm_bias else None,
           "lm_head.bias": ("lm_head_b", (V,)) if cfg.family in HEAD_BIAS_FAMILIES else None,
           "model.embed_positions.weight": ("pos_embed", (cfg.max_position_embeddings, E)) if learned else None,
           "model.embed_norm.weight": ("embed_norm", (E,)), "model.embed_norm.bias": ("embed_norm_b", (E,))}
    if top.get(name):  # (the head's weight transposed: ours is [E, V])
        return Target(top[name][0], None, (lambda w: w.T) if name == "lm_head.weight" else (lambda w: w), top[name][1])
    m = _LAYER_RE.match(name)
    if m:
        layer, rest = int(m.group(1)), m.group(2)
        if layer >= cfg.num_layers:
            if cfg.family in ("glm4_moe", "deepseek_v3", "glm4_moe_lite", "dots1", *DSA_FAMILIES):  # (MTP: not read)
                return None
            raise CheckpointError(f"tensor {name!r} names layer {layer}, but the model has {cfg.num_layers} layers")
        dense = cfg.dense_layer(layer)
        if cfg.hidden_act == "xielu" and rest in _XIELU:  # its four scalars: one row of `layers.xielu` a layer
            column, shape = _XIELU[rest]
            return Target("layers.xielu", layer, lambda w: w.reshape(()), shape, column)
        if cfg.family == "stablelm" and cfg.qk_norm and (m := _STABLELM_NORM.match(rest)):
            heads = cfg.num_heads if m.group(1) == "q" else cfg.num_kv_heads
            if int(m.group(2)) >= heads:
                raise CheckpointError(f"tensor {name!r} names head {m.group(2)}, but the layer has {heads}")
            return Target(f"layers.{m.group(1)}_norm", layer, lambda w: w, (cfg.head_dim,), int(m.group(2)))
        spec = _layer_targets(cfg, dense).get(rest)
        if cfg.mamba is not None:  # a hybrid model: its mixers' tensors on their own stacks
            spec = hybrid_spec(cfg, layer, rest, spec)
            if spec is not None:
                return Target(spec[0], spec[3], spec[1], spec[2], cols=spec[4] if len(spec) > 4 else None)
        if spec is not None:
            path, transform, shape, *cols = spec
            return Target(("dense_" if dense else "") + path, cfg.stack_index(layer, dense), transform, shape, cols=(cols or [None])[0])
        e = _EXPERT_RE.match(rest) if cfg.num_experts and (not dense or cfg.gemma4 is not None) else None
        if e and e.group(1) == _moe_module(cfg):
            expert, kind = int(e.group(2)), e.group(3)
            if expert >= cfg.num_experts:
                raise CheckpointError(f"tensor {name!r} names expert {expert}, but the model has "
                                      f"{cfg.num_experts} experts")
            if kind in _expert_targets(cfg):
                path, shape = _expert_targets(cfg)[kind]
                spec = ("dense_" * dense + path, lambda w: w.T, shape, cfg.stack_index(layer, dense))
                spec = spec if cfg.mamba is None else hybrid_spec(cfg, layer, rest, spec[:3])  # (a hybrid's MLPs apart)
                if spec is not None:
                    return Target(spec[0], spec[3], spec[1], spec[2], expert)
    raise CheckpointError(f"unknown tensor {name!r} for a {cfg.family} model")


def layer_field(path: str) -> str:
    """A parameter path's layer field ("layers.wq", "dense_layers.wq": "wq"); other paths as they are."""
    return re.sub(r"^(dense_|attn_|mamba_|mlp_)?layers\.", "", path)


def hf_names(cfg: ModelConfig) -> list[str]:
    """Every HF tensor name a checkpoint of `cfg` must hold (the inverse of `hf_target`)."""
    names = ["model.embed_tokens.weight", "model.norm.weight", *["model.norm.bias"] * cfg.norm_bias,
             *["model.embed_positions.weight"] * (cfg.family in LEARNED_POSITION_FAMILIES), *own_top_names(cfg)]
    if not cfg.tie_word_embeddings:
        names.extend(["lm_head.weight", *["lm_head.bias"] * (cfg.family in HEAD_BIAS_FAMILIES)])
    for i in range(cfg.num_layers):
        dense = cfg.dense_layer(i)
        rests = [r for r in _layer_targets(cfg, dense) if (r != "self_attn.sinks" or cfg.sinks_in(i)) and (
            not r.startswith("self_attn.indexer.") or i not in cfg.index_shared_layers)]
        names.extend(f"model.layers.{i}.{rest}" for rest in (
            rests if cfg.mamba is None else hybrid_layer_names(cfg, i, rests)))
        if cfg.hidden_act == "xielu":
            names.extend(f"model.layers.{i}.{rest}" for rest in _XIELU)
        if cfg.family == "stablelm" and cfg.qk_norm:
            names.extend(f"model.layers.{i}.self_attn.{x}_layernorm.norms.{h}.weight" for x, heads in (
                ("q", cfg.num_heads), ("k", cfg.num_kv_heads)) for h in range(heads))
        for j in range(0 if dense and cfg.gemma4 is None or cfg.mamba is not None and i in cfg.mamba.no_mlp
                       else cfg.num_experts):
            names.extend(f"model.layers.{i}.{_moe_module(cfg)}.experts.{j}.{kind}" for kind in _expert_targets(cfg))
    if cfg.family in WEIGHTLESS_NORM_FAMILIES:  # (OLMo's LayerNorms: no weights)
        names = [n for n in names if not n.endswith("layernorm.weight") and n != "model.norm.weight"]
    return names if cfg.gemma4 is None else gemma4_names(cfg, names)


def hf_tensors(cfg: ModelConfig, params_flat: dict[str, np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
    """Every (HF name, HF-layout tensor) of a checkpoint of `cfg`, from our (host) parameters, packed as the family's
    checkpoints pack them (Granite MoE's experts and shared MLP, GLM's `gate_up_proj`, ...) and under its names."""
    pairs = ((name, to_hf_tensor(name, cfg, params_flat)) for name in hf_names(cfg))
    if cfg.family in GLM_FAMILIES:
        gate = None
        for name, t in pairs:
            if name.endswith("mlp.gate_proj.weight"):
                gate = t
            elif name.endswith("mlp.up_proj.weight"):
                yield name.replace("up_proj", "gate_up_proj"), np.concatenate([gate, t])
            else:
                yield name, t
        return
    if cfg.family == "gpt_oss" or (cfg.family == "qwen3_moe" and cfg.mrope_section is not None):  # Qwen3-VL-MoE
        yield from gpt_oss_packed(pairs, cfg)
        return
    if cfg.kv_lora_rank:  # (Mistral 4's experts packed)
        yield from gpt_oss_packed(mla_fused(pairs, cfg), cfg) if cfg.family == "mistral4" else mla_fused(pairs, cfg)
        return
    written = {"qwen3_next": qwen3_next_fused, **dict.fromkeys(LAYOUTS, own_written), "mimo_v2_flash": mimo_written,
               "gemma4": gemma4_written,
               "llama4": lambda p, c: ((family_hf_name(n, c), t) for n, t in gpt_oss_packed(p, c))}
    if cfg.family in written:  # (Qwen3-Next's projections fused; MiMo's heads and values; experts packed, own names)
        yield from written[cfg.family](pairs, cfg)
        return
    yield from ((family_hf_name(name, cfg), t) for name, t in (granite_fused(pairs, cfg) if cfg.family in
                                                               GRANITE_MOE_FAMILIES else hybrid_written(pairs, cfg)))


def to_hf_tensor(name: str, cfg: ModelConfig, params_flat: dict[str, np.ndarray]) -> np.ndarray:
    """The HF-layout tensor for `name` from our (host) parameters; inverse of the load transform."""
    target = hf_target(name, cfg)
    assert target is not None
    value = params_flat[target.path]
    if target.layer is not None:
        value = value[target.layer]
    if target.cols is not None:
        value = value[..., target.cols[0]:target.cols[1]]
    if target.path == "layers.xielu":
        return value[target.expert].reshape(target.hf_shape)
    if target.expert is not None:
        return value[target.expert].T
    field = layer_field(target.path)
    if cfg.kv_lora_rank and field in MLA_FIELDS:
        return mla_hf_tensor(field, value, cfg)
    if field == "ws_mix":
        return value.reshape(1, -1)
    if field == "router_bias" and cfg.family == "ernie4_5_moe":
        return value.reshape(1, -1)
    if cfg.family in INTERLEAVED_ROPE_FAMILIES and (field in ("wq", "wk", "bq", "bk")
                                                    or field in ("q_norm", "k_norm") and value.ndim == 2):
        # Back to interleaved rotary pairs: each head's dims in the inverse of the order they were read in.
        value = value[..., np.argsort(_halfsplit_order(cfg.head_dim, cfg.rotary_dims))]
    if field in ("wq", "wk", "wv"):
        return value.reshape(value.shape[0], -1).T
    if field == "wo":
        return value.reshape(-1, value.shape[-1]).T
    if field in ("w_gate", "w_up", "w_down", "lm_head", "router", "ws_gate", "ws_up", "ws_down", "m_in", "m_out",
                 "we_latent_in", "we_latent_out", "m_x", "m_dt", "ple_proj", "ple_gate", "ple_out"):
        return value.T
    return value.reshape(-1) if field in ("bq", "bk", "bv") or field in ("q_norm", "k_norm") and cfg.qk_norm_heads \
        else value.reshape(target.hf_shape)  # (a Mamba layer's convolution: [channels, 1, taps])
