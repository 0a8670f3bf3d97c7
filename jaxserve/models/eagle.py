"""EAGLE and EAGLE-3 draft heads: small decoder stacks trained to draft tokens from the served model's hidden states
(speculative decoding's methods "eagle" and "eagle3", `engine.eagle`).

EAGLE-3 (config `LlamaForCausalLMEagle3`, as the EAGLE-3 releases write it, or speculators' `Eagle3Speculator`, its
decoder's config under `transformer_layer_config`): the served model's hidden states entering three of its layers
(`eagle_aux_hidden_state_layer_ids`, top level or in `eagle_config`; by default layers 2, L/2 and L-3, as vLLM picks
them; layer 0's are the embeddings), side by side, projected by `fc` [E, 3 E_target]. At position i, with the token
after it x_{i+1} and that projection r:

    attention input = [input_layernorm(embed(x_{i+1})), hidden_norm(r)]   (the first layer's q/k/v read 2E)
    residual = r (hidden_norm(r) with `norm_before_residual`)

then the rest of a Llama decoder layer, any further layers as Llama's, and `lm_head(norm(out))` over a draft
vocabulary of `draft_vocab_size` ids (draft id d stands for the served model's d + d2t[d]). Drafting further, the head
reads its own output (before `norm`) in place of r. Tensors: `midlayer.*` or `layers.N.*` (the decoder layers, with
`hidden_norm`), `fc`, `norm`, `lm_head`, `d2t` (`t2d` unread), and `embed_tokens` (else the served model's).

EAGLE (vLLM's "eagle"; the EAGLE releases' Llama configs): x = fc([embed(x_{i+1}), final_norm(h_i)]) (`fc.bias` when
the checkpoint has one; HASS heads, `add_para_norm`, norm both halves first), then Llama decoder layers whose first
has no input norm, and the served model's head straight from the output (no norm); embedding and head are the served
model's. speculators' `EagleSpeculator` writes the same head as `fusion_fc` and one layer `transformer.*`; with its
`layernorms`, the embedding alone is normed before `fusion_fc` (`embedding_layernorm`), the layer has its input norm,
and the output is normed before the head (`pre_lm_head_layernorm`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models.inputs import KVCache, ModelInputs
from jaxserve.models.llama import forward
from jaxserve.models.ops import model_norm, rms_norm
from jaxserve.models.params import LayerParams, Params

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator")
EAGLE_ARCHITECTURES = ("LlamaForCausalLMEagle", "EagleLlamaForCausalLM", "EagleSpeculator")


@dataclass(frozen=True)
class EagleConfig:
    """An EAGLE head, as its checkpoint's config.json and the served model's config declare it."""

    method: Literal["eagle", "eagle3"]
    model: ModelConfig  # its decoder layers, as a Llama model's (ids of the served model's vocabulary)
    target: ModelConfig  # the served model's
    aux_layers: tuple[int, ...] = ()  # EAGLE-3: the served model's layers whose entering hidden states it reads
    draft_vocab: int = 0  # EAGLE-3: its vocabulary's size
    norm_before_residual: bool = False  # EAGLE-3: the residual is hidden_norm(r)
    para_norms: bool = False  # EAGLE (HASS): the embedding and the hidden state normed before `fc`
    layernorms: bool = False  # EAGLE (speculators'): the embedding normed before `fc`, input and output norms

    @property
    def hidden_width(self) -> int:
        """The width of the served model's hidden states it reads: [T, width]."""
        return self.target.hidden_size * max(1, len(self.aux_layers))


def eagle_kind(d: dict[str, Any]) -> str | None:
    """"eagle3" or "eagle" for the config.json of an EAGLE-3 or EAGLE head that names itself one (its architecture,
    speculators' model type); None for any other (the EAGLE releases' heads name the Llama architecture)."""
    archs = set(d.get("architectures") or [])
    if archs & set(EAGLE3_ARCHITECTURES) or d.get("speculators_model_type") == "eagle3":
        return "eagle3"
    if archs & set(EAGLE_ARCHITECTURES) or d.get("speculators_model_type") == "eagle":
        return "eagle"
    return None


def eagle_config(d: dict[str, Any], method: str, target: ModelConfig, name: str) -> EagleConfig:
    """The head of config.json `d` (at `name`) drafting by `method` for a model of config `target`; ValueError naming
    what does not fit."""
    kind = eagle_kind(d)
    if kind is not None and kind != method:
        raise ValueError(f"{name} is an {kind.upper().replace('EAGLE3', 'EAGLE-3')} head; use speculative method "
                         f"{kind!r}, not {method!r}")
    layer = dict(d.get("transformer_layer_config") or d)
    if layer.get("model_type", "llama") != "llama":
        raise ValueError(f"{name}: an EAGLE head of {layer.get('model_type')!r} layers is not supported (Llama's are)")
    eagle = d.get("eagle_config") or {}
    if method == "eagle3" and not eagle.get("use_aux_hidden_state", True):
        raise ValueError(f"{name}: an EAGLE-3 head without the served model's earlier layers' hidden states "
                         "(use_aux_hidden_state false) is not supported")
    if method == "eagle3":
        L = target.num_layers
        aux = tuple(d.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
                    or (2, L // 2, L - 3))
        if not all(isinstance(j, int) and 0 <= j <= L for j in aux):
            raise ValueError(f"{name}: eagle_aux_hidden_state_layer_ids {list(aux)} must be layers of the served model "
                             f"(0 to {L})")
    else:
        aux = ()
    vocab = layer.get("vocab_size", target.vocab_size)
    if vocab != target.vocab_size:
        raise ValueError(f"{name} drafts over a vocabulary of {vocab} ids; the served model's has "
                         f"{target.vocab_size}: a head for another model")
    width = d.get("target_hidden_size") or layer.get("target_hidden_size") or layer["hidden_size"]
    if width != target.hidden_size or (method == "eagle" and layer["hidden_size"] != target.hidden_size):
        raise ValueError(f"{name} reads hidden states {width} wide; the served model's are {target.hidden_size}: "
                         "a head for another model")
    model = ModelConfig.from_hf({**layer, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                 "vocab_size": target.vocab_size, "tie_word_embeddings": False,
                                 "max_position_embeddings": max(layer.get("max_position_embeddings", 0),
                                                                target.max_position_embeddings)})
    return EagleConfig(method, model, target, aux, int(d.get("draft_vocab_size") or vocab),
                       bool(d.get("norm_before_residual", layer.get("norm_before_residual", False))),
                       bool(layer.get("add_para_norm", False)), method == "eagle" and bool(d.get("layernorms")))


@jax.tree_util.register_dataclass
@dataclass
class EagleParams:
    """An EAGLE head's weights."""

    model: Params  # embedding, decoder layers (a tuple), final norm (EAGLE: None), head [E, V'] (EAGLE: the model's)
    fc: Any  # [in, E]: the served model's hidden states (EAGLE: with the embedding) to the head's width
    fc_bias: Any  # [E] or None
    norms: Any  # EAGLE-3: (input_layernorm, hidden_norm) of the first layer; HASS: the two halves' norms; else None
    to_target: Any  # EAGLE-3 with a draft vocabulary: [V'] int32, each draft id's id in the served model's
    target_norm: Any  # EAGLE: the served model's final norm (its hidden states are read normed); else None


def _renamed(name: str) -> str:
    """A head's tensor named without the `model.` prefix, its first layer `midlayer` (speculators' EAGLE: `transformer`)
    as `layers.0`, speculators' `fusion_fc` as `fc`."""
    name = name.removeprefix("model.")
    for old, new in (("midlayer.", "layers.0."), ("transformer.", "layers.0."), ("fusion_fc.", "fc.")):
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _layer(w: dict[str, np.ndarray], i: int, cfg: ModelConfig, first: bool, method: str, put,
           first_norm: bool = False) -> LayerParams:
    """Decoder layer `i` of tensors `w` as the model's forward takes it (unstacked); an EAGLE-3 head's first reads
    [embedding, hidden state] (2E) and its norms are the head's own; an EAGLE head's first has no input norm (but
    with `first_norm`, speculators' `layernorms`)."""
    from jaxserve.loader.keymap import CheckpointError

    Hq, Hkv, D, E = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    width = 2 * E if first and method == "eagle3" else E
    want = {"self_attn.q_proj.weight": (Hq * D, width), "self_attn.k_proj.weight": (Hkv * D, width),
            "self_attn.v_proj.weight": (Hkv * D, width), "self_attn.o_proj.weight": (E, Hq * D),
            "mlp.gate_proj.weight": (cfg.intermediate_size, E), "mlp.up_proj.weight": (cfg.intermediate_size, E),
            "mlp.down_proj.weight": (E, cfg.intermediate_size), "post_attention_layernorm.weight": (E,)}
    if not (first and method == "eagle") or first_norm:
        want["input_layernorm.weight"] = (E,)
    for key, shape in want.items():
        got = w.get(f"layers.{i}.{key}")
        if got is None:
            raise CheckpointError(f"the EAGLE head is missing layers.{i}.{key}")
        if got.shape != shape:
            raise CheckpointError(f"the EAGLE head's layers.{i}.{key} has shape {got.shape}, expected {shape}")
    t = lambda key: w[f"layers.{i}.{key}"]  # noqa: E731
    bias = lambda key, shape: None if f"layers.{i}.{key}" not in w else put(t(key).reshape(shape))  # noqa: E731
    return LayerParams(
        attn_norm=put(t("input_layernorm.weight")) if not first or first_norm else None,
        wq=put(t("self_attn.q_proj.weight").T.reshape(width, Hq, D)),
        wk=put(t("self_attn.k_proj.weight").T.reshape(width, Hkv, D)),
        wv=put(t("self_attn.v_proj.weight").T.reshape(width, Hkv, D)),
        wo=put(t("self_attn.o_proj.weight").T.reshape(Hq, D, E)),
        mlp_norm=put(t("post_attention_layernorm.weight")),
        w_gate=put(t("mlp.gate_proj.weight").T), w_up=put(t("mlp.up_proj.weight").T),
        w_down=put(t("mlp.down_proj.weight").T),
        bq=bias("self_attn.q_proj.bias", (Hq, D)), bk=bias("self_attn.k_proj.bias", (Hkv, D)),
        bv=bias("self_attn.v_proj.bias", (Hkv, D)), bo=bias("self_attn.o_proj.bias", (E,)))


def load_eagle_params(tensors: Iterable[tuple[str, np.ndarray]], ecfg: EagleConfig, target: Params,
                      dtype: Any) -> EagleParams:
    """The head of checkpoint `tensors` (as stored; `_renamed`), the served model's `target` weights lending the
    embedding (when the head has none; EAGLE: always) and head (EAGLE)."""
    from jaxserve.loader.keymap import CheckpointError

    np_dtype = np.dtype(jnp.dtype(dtype))
    put = lambda a: jnp.asarray(np.asarray(a, np.float32).astype(np_dtype))  # noqa: E731
    w = {_renamed(n): a for n, a in tensors}
    cfg, E, eagle3 = ecfg.model, ecfg.model.hidden_size, ecfg.method == "eagle3"
    width = ecfg.hidden_width if eagle3 else 2 * E
    if w.get("fc.weight", np.zeros(0)).shape != (E, width):
        raise CheckpointError(f"the EAGLE head's fc.weight has shape {w.get('fc.weight', np.zeros(0)).shape}, "
                              f"expected {(E, width)}")
    layers = tuple(_layer(w, i, cfg, i == 0, ecfg.method, put, ecfg.layernorms) for i in range(cfg.num_layers))
    embed = put(w["embed_tokens.weight"]) if eagle3 and "embed_tokens.weight" in w else target.embed
    if embed.shape != (cfg.vocab_size, E):
        raise CheckpointError(f"the EAGLE head's embedding has shape {embed.shape}, expected {(cfg.vocab_size, E)}")
    if eagle3:
        head = w.get("lm_head.weight")
        if head is None or head.shape != (ecfg.draft_vocab, E) or "norm.weight" not in w:
            raise CheckpointError(f"the EAGLE-3 head needs norm.weight and lm_head.weight [{ecfg.draft_vocab}, {E}]"
                                  + ("" if head is None else f" (it has {head.shape})"))
        ids = None if "d2t" not in w else np.arange(len(w["d2t"])) + np.asarray(w["d2t"], np.int64)
        if ids is None and ecfg.draft_vocab != cfg.vocab_size or ids is not None and (
                len(ids) != ecfg.draft_vocab or ids.min() < 0 or ids.max() >= cfg.vocab_size):
            raise CheckpointError(f"the EAGLE-3 head's d2t does not map its {ecfg.draft_vocab} draft ids into the "
                                  f"served model's {cfg.vocab_size}")
        to_target = None if ids is None else jnp.asarray(ids, jnp.int32)
        if "layers.0.hidden_norm.weight" not in w:
            raise CheckpointError("the EAGLE-3 head is missing layers.0.hidden_norm.weight")
        model = Params(embed=embed, layers=layers, final_norm=put(w["norm.weight"]), lm_head=put(head.T))
        norms = (put(w["layers.0.input_layernorm.weight"]), put(w["layers.0.hidden_norm.weight"]))
    else:
        named = ("embedding_layernorm.weight", "hidden_states_layernorm.weight") if ecfg.para_norms else \
            ("embedding_layernorm.weight", "pre_lm_head_layernorm.weight") if ecfg.layernorms else ()
        if missing := [n for n in named if n not in w]:
            raise CheckpointError(f"the EAGLE head is missing {', '.join(missing)}")
        model = Params(embed=embed, layers=layers, final_norm=put(w[named[1]]) if ecfg.layernorms else None,
                       lm_head=target.lm_head, lm_head_t=target.lm_head_t)
        # (the embedding's norm and the hidden state's: HASS normed both, speculators' the embedding alone)
        norms = (put(w[named[0]]), None if ecfg.layernorms else put(w[named[1]])) if named else None
        to_target = None
    return EagleParams(model=model, fc=put(w["fc.weight"].T),
                       fc_bias=put(w["fc.bias"]) if "fc.bias" in w else None, norms=norms, to_target=to_target,
                       target_norm=None if eagle3 else jnp.asarray(target.final_norm))


def eagle_forward(p: EagleParams, kv: KVCache, inputs: ModelInputs, prev: jax.Array, ecfg: EagleConfig, backend: str,
                  from_target: bool) -> tuple[jax.Array, KVCache, jax.Array]:
    """The head over a ragged batch whose `inputs.token_ids` are each position's next token and `prev` the hidden
    states before it: the served model's (`from_target`, static: as its steps keep them, `EagleConfig.hidden_width`
    wide) or the head's own. Returns greedy drafts at `inputs.logits_indices` [R] (ids of the served model's
    vocabulary), the head's KV pool and its outputs [T, E]."""
    cfg = ecfg.model
    emb = p.model.embed[inputs.token_ids]
    if from_target and ecfg.method == "eagle3":
        prev = jnp.dot(prev.astype(emb.dtype), p.fc, preferred_element_type=jnp.float32).astype(emb.dtype)
    if ecfg.method == "eagle3":
        prev = prev.astype(emb.dtype)
        first, second = p.norms
        eps = cfg.rms_norm_eps
        attn = jnp.concatenate([rms_norm(emb, first, eps), rms_norm(prev, second, eps)], axis=-1)
        residual = rms_norm(prev, second, eps) if ecfg.norm_before_residual else prev
        logits, kv, out = forward(p.model, kv, inputs, cfg, backend, return_hidden=True, embeds=residual,
                                  attn_inputs=attn)
    else:
        if from_target:
            prev = model_norm(ecfg.target, prev, p.target_norm)
        prev = prev.astype(emb.dtype)
        if p.norms is not None:
            emb = rms_norm(emb, p.norms[0], cfg.rms_norm_eps)
            prev = prev if p.norms[1] is None else rms_norm(prev, p.norms[1], cfg.rms_norm_eps)
        x = jnp.dot(jnp.concatenate([emb, prev], axis=-1), p.fc, preferred_element_type=jnp.float32)
        x = (x if p.fc_bias is None else x + p.fc_bias).astype(emb.dtype)
        logits, kv, out = forward(p.model, kv, inputs, cfg, backend, return_hidden=True, embeds=x)
    ids = jnp.argmax(logits[:, :cfg.vocab_size], axis=-1).astype(jnp.int32)
    return (ids if p.to_target is None else p.to_target[ids]), kv, out
