"""A model's multi-token prediction (MTP) layer, which drafts tokens for speculative decoding (`engine.mtp`).

DeepSeek-V3 (and R1, V3.1, Kimi-like variants that keep it), DeepSeek-V3.2, GLM-4.5 / 4.6, GLM-4.7-Flash and GLM-5
checkpoints carry
`num_nextn_predict_layers` such layers after their decoder layers, under `model.layers.{num_hidden_layers + i}.`:
a decoder layer of the model's own kind (its attention and experts), and
- `embed_tokens` (the model's embedding, repeated), `enorm` and `hnorm` (RMSNorms), `eh_proj` [E, 2E];
- `shared_head.norm` and `shared_head.head` (a final norm and vocabulary projection of its own).

At position i the layer reads the model's last hidden state h_i (after the model's final norm) and the embedding
of the token after it, x_{i+1} (zeroed at position 0, as vLLM does):

    x = eh_proj([enorm(embed(x_{i+1})), hnorm(h_i)])

then its decoder layer, attending over its own keys and values of positions 0..i (a one-layer KV pool), and its
head: logits for x_{i+2}. Drafting further, the layer reads its own output (before `shared_head.norm`) in place
of h (one layer drafts any number of tokens; it was trained for the first).

Qwen3-Next's and Qwen3.5's (`mtp_num_hidden_layers`) are the same rule under other names, after the model's own
tensors: `mtp.pre_fc_norm_embedding` and `mtp.pre_fc_norm_hidden` (enorm, hnorm; scaled by 1 + w as all their
norms), `mtp.fc` (eh_proj), `mtp.layers.0.` (a gated attention layer with the model's MLP or experts) and `mtp.norm`
(its final norm), the model's embedding and head; the embedding is not zeroed at position 0 (as vLLM runs theirs).

The layer is held as a one-layer model of the target's config (`mtp_config`), so the model's own forward
(`llama.forward` with `embeds`) runs it: paged attention, latent attention, experts and all."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.config_mla import DSA_FAMILIES
from jaxserve.config_qwen3_next import GATED_DELTA_FAMILIES
from jaxserve.models.inputs import KVCache, ModelInputs
from jaxserve.models.llama import forward
from jaxserve.models.ops import model_norm
from jaxserve.models.params import Params

MTP_FAMILIES = ("deepseek_v3", "glm4_moe", "glm4_moe_lite", *DSA_FAMILIES, *GATED_DELTA_FAMILIES)
_QWEN_MTP = {"fc.": "eh_proj.", "pre_fc_norm_embedding.": "enorm.", "pre_fc_norm_hidden.": "hnorm."}


@jax.tree_util.register_dataclass
@dataclass
class MtpParams:
    """One MTP layer's weights."""

    model: Params  # the embedding, the decoder layer, `shared_head.norm` as the final norm, `shared_head.head`
    enorm: Any  # [E]
    hnorm: Any  # [E]
    eh_proj: Any  # [2E, E]: [normed embedding, normed hidden state] -> the layer's input
    norm: Any  # [E]: the target model's final norm (its hidden states are read normed)


def mtp_config(target: ModelConfig, layers: int) -> ModelConfig:
    """The one-layer model config the MTP layer runs as (the `target`'s, its experts in its one layer, untied, held in
    float), the checkpoint having `layers` of them; ValueError when the model has none."""
    if target.family not in MTP_FAMILIES:
        raise ValueError(f"speculative method 'mtp' drafts with a model's multi-token prediction layers, which "
                         f"jaxserve reads for DeepSeek-V3 and V3.2, GLM-4.5, GLM-4.7-Flash, GLM-5, Qwen3-Next and Qwen3.5 "
                         f"checkpoints; {target.family}'s "
                         "are not read: use method 'ngram' or 'draft_model'")
    if layers < 1:
        raise ValueError("speculative method 'mtp' needs the model's multi-token prediction layers, and this "
                         "checkpoint has none (its config's num_nextn_predict_layers or mtp_num_hidden_layers is 0; a "
                         "GGUF file: no "
                         "blk.N.nextn tensors); use method 'ngram' or 'draft_model'")
    return dataclasses.replace(target, num_layers=1, first_dense_layers=0, tie_word_embeddings=False,
                               weight_quant=None, kv_cache_scales=False,
                               mamba=None, index_shared_layers=())  # (a hybrid's: an attention layer; its own indexer)


def mtp_tensor_name(name: str, first: int) -> str | None:
    """A checkpoint tensor of the MTP layer `model.layers.{first}.` (or Qwen3-Next's `mtp.`) as the one-layer model
    names it (the layer's own parts `mtp.enorm.weight`, `mtp.hnorm.weight`, `mtp.eh_proj.weight`); None for the
    model's other tensors."""
    if name.startswith("mtp."):  # Qwen3-Next's, Qwen3.5's
        rest = name[len("mtp."):]
        own = next((k for k in _QWEN_MTP if rest.startswith(k)), None)
        if own is not None:
            return "mtp." + _QWEN_MTP[own] + rest[len(own):]
        return "model.norm.weight" if rest == "norm.weight" else "model." + rest if rest.startswith("layers.0.") \
            else None
    prefix = f"model.layers.{first}."
    if not name.startswith(prefix):
        return None
    rest = name[len(prefix):]
    if rest.startswith(("enorm.", "hnorm.", "eh_proj.")):
        return "mtp." + rest
    return {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.norm.weight": "model.norm.weight",
            "shared_head.head.weight": "lm_head.weight"}.get(rest, "model.layers.0." + rest)


def load_mtp_params(tensors: Iterable[tuple[str, np.ndarray]], cfg: ModelConfig, target: Params, first: int,
                    dtype: Any) -> MtpParams:
    """The MTP layer `model.layers.{first}.` from a checkpoint's `tensors` (HF names; the others are skipped), as `cfg`
    (`mtp_config`) declares it; the embedding or head a checkpoint leaves out is the `target`'s."""
    from jaxserve.loader.assembler import WeightAssembler
    from jaxserve.loader.keymap import CheckpointError

    np_dtype = np.dtype(jnp.dtype(dtype))
    assembler, own, seen = WeightAssembler(cfg, np_dtype), {}, set()
    for name, array in tensors:
        renamed = mtp_tensor_name(name, first)
        if renamed is None:
            continue
        seen.add(renamed)
        if renamed.startswith("mtp."):
            own[renamed] = array
        else:
            assembler.add(renamed, array)
    if not seen:
        raise CheckpointError(f"the checkpoint carries no multi-token prediction weights (model.layers.{first}.*), "
                              "though its config names num_nextn_predict_layers")
    if "model.embed_tokens.weight" not in seen:
        assembler.add("model.embed_tokens.weight", np.asarray(jax.device_get(target.embed), np.float32))
    if "lm_head.weight" not in seen:  # (HF's [V, E]: ours is [E, V], or [V, E] laid out per layer, or the embedding)
        head = target.lm_head_t if target.lm_head_t is not None else target.embed if target.lm_head is None \
            else jnp.transpose(target.lm_head)
        assembler.add("lm_head.weight", np.asarray(jax.device_get(head), np.float32))
    E = cfg.hidden_size
    want = {"mtp.enorm.weight": (E,), "mtp.hnorm.weight": (E,), "mtp.eh_proj.weight": (E, 2 * E)}
    for name, shape in want.items():
        if name not in own:
            raise CheckpointError(f"checkpoint is missing the MTP layer's {name.replace('mtp.', f'model.layers.{first}.')}")
        if own[name].shape != shape:
            raise CheckpointError(f"tensor {name.replace('mtp.', f'model.layers.{first}.')} has shape "
                                  f"{own[name].shape}, expected {shape} for this config")
    put = lambda a: jnp.asarray(np.asarray(a).astype(np_dtype))  # noqa: E731
    return MtpParams(model=assembler.finish(lambda _p, host: jnp.asarray(host)), enorm=put(own["mtp.enorm.weight"]),
                     hnorm=put(own["mtp.hnorm.weight"]), eh_proj=put(own["mtp.eh_proj.weight"].T),
                     norm=jnp.asarray(target.final_norm))


def mtp_forward(p: MtpParams, kv: KVCache, inputs: ModelInputs, prev: jax.Array, cfg: ModelConfig, backend: str,
                from_target: bool) -> tuple[jax.Array, KVCache, jax.Array]:
    """The layer over a ragged batch whose `inputs.token_ids` are each position's next token and `prev` [T, E] the
    hidden states before it: the target model's (before its final norm: `from_target`, static) or the layer's own.
    Returns logits at `inputs.logits_indices` [R, V] float32, the layer's KV pool and its outputs [T, E]."""
    if from_target:
        prev = model_norm(cfg, prev, p.norm)
    emb = p.model.embed[inputs.token_ids]
    if cfg.family not in GATED_DELTA_FAMILIES:
        emb = jnp.where((inputs.positions == 0)[:, None], jnp.zeros_like(emb), emb)
    x = jnp.concatenate([model_norm(cfg, emb, p.enorm), model_norm(cfg, prev.astype(emb.dtype), p.hnorm)], axis=-1)
    x = jnp.dot(x, p.eh_proj, preferred_element_type=jnp.float32).astype(emb.dtype)
    return forward(p.model, kv, inputs, cfg, backend, return_hidden=True, embeds=x)


def unstacked(p: MtpParams, unstack) -> MtpParams:
    """`p` with its decoder layer laid out by `unstack` (`params.unstack_layers`)."""
    return dataclasses.replace(p, model=unstack(p.model))
