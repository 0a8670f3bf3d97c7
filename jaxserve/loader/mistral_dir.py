"""Mistral's own checkpoint format: a directory of `params.json`, `consolidated*.safetensors` and (for the tokenizer)
`tekken.json` (older releases: `tokenizer.model.v3` / `.v7`), as Mistral publishes its models (some, such as Mistral
Small 3.2, Magistral and Devstral, only so).

The directory is read as the HF Mistral model it is: `params.json` gives the config (`hf_config`), each tensor
its HF name (`layers.{i}.attention.wq.weight` -> `model.layers.{i}.self_attn.q_proj.weight`, ...), and the q and
k projections' rows are reordered from the interleaved rotary pairs Mistral's code turns (dims 2i and 2i + 1)
into the half-split order the model turns (dims i and i + head_dim / 2), as transformers' converter does. A
vision encoder (`vision_encoder` in params.json: Mistral Small 3.1 / 3.2, Magistral Small 1.2, Pixtral) is read as
the HF model transformers' converter makes of it: Mistral 3 with a patch merger (`mm_projector_id` "patch_merge"),
else LLaVA over a Pixtral tower, its q and k rows reordered as the language model's, its image processing from the
tokenizer file's `image` settings (mistral_common's) or the encoder's. Experts (`moe`), YaRN scaling and other
options of newer files are refused by name.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from jaxserve.errors import CheckpointError, UnsupportedModelError
from jaxserve.loader.hf_dir import HFDirectory

PARAMS_FILE = "params.json"
_KNOWN = {"dim", "n_layers", "head_dim", "hidden_dim", "n_heads", "n_kv_heads", "norm_eps", "vocab_size",
          "rope_theta", "max_seq_len", "max_position_embeddings", "sliding_window", "tied_embeddings",
          "vision_encoder", "model_type", "max_batch_size", "use_biases"}
_VISION_PREFIX = re.compile(r"^(vision_encoder|vision_language_adapter|patch_merger|pre_mm_projector_norm)\.")
_VISION_LAYER = re.compile(r"^vision_encoder\.transformer\.layers\.(\d+)\.(.+)$")
_VISION_NAMES = {"attention_norm.weight": "attention_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
                 "attention.wq.weight": "attention.q_proj.weight", "attention.wk.weight": "attention.k_proj.weight",
                 "attention.wv.weight": "attention.v_proj.weight", "attention.wo.weight": "attention.o_proj.weight",
                 "feed_forward.w1.weight": "feed_forward.gate_proj.weight",
                 "feed_forward.w2.weight": "feed_forward.down_proj.weight",
                 "feed_forward.w3.weight": "feed_forward.up_proj.weight"}
_VISION_TOP = {"vision_encoder.patch_conv.weight": "vision_tower.patch_conv.weight",
               "vision_encoder.ln_pre.weight": "vision_tower.ln_pre.weight",
               "patch_merger.merging_layer.weight": "multi_modal_projector.patch_merger.merging_layer.weight",
               "pre_mm_projector_norm.weight": "multi_modal_projector.norm.weight",
               **{f"vision_language_adapter.w_{io}.{p}": f"multi_modal_projector.linear_{n}.{p}"
                  for io, n in (("in", 1), ("out", 2)) for p in ("weight", "bias")}}
# params.json's vision_encoder fields, as transformers' converter passes them to PixtralVisionConfig.
_VISION_FIELDS = ("hidden_size", "num_channels", "image_size", "patch_size", "rope_theta", "intermediate_size",
                  "num_hidden_layers", "num_attention_heads")
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_NAMES = {"attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
          "attention.wq.weight": "self_attn.q_proj.weight", "attention.wk.weight": "self_attn.k_proj.weight",
          "attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
          "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w2.weight": "mlp.down_proj.weight",
          "feed_forward.w3.weight": "mlp.up_proj.weight"}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}


def is_mistral_dir(path: str) -> bool:
    """Whether `path` is a Mistral-format directory and not (also) an HF one, whose config.json wins."""
    return (os.path.isfile(os.path.join(path, PARAMS_FILE)) and not os.path.isfile(os.path.join(path, "config.json"))
            and any(f.startswith("consolidated") and f.endswith(".safetensors") for f in os.listdir(path)))


def hf_config(params: Mapping[str, Any]) -> dict[str, Any]:
    """The HF `MistralForCausalLM` config of a `params.json`; options jaxserve does not read are refused by name."""
    unknown = sorted(set(params) - _KNOWN)
    if unknown or params.get("use_biases"):
        raise UnsupportedModelError(f"Mistral params.json options {unknown or ['use_biases']} are not supported "
                                    f"(read: {', '.join(sorted(_KNOWN - {'use_biases'}))})")
    try:
        d: dict[str, Any] = {
            "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": params["dim"],
            "num_hidden_layers": params["n_layers"], "intermediate_size": params["hidden_dim"],
            "num_attention_heads": params["n_heads"], "num_key_value_heads": params.get("n_kv_heads", params["n_heads"]),
            "head_dim": params.get("head_dim") or params["dim"] // params["n_heads"],
            "rms_norm_eps": params.get("norm_eps", 1e-5), "vocab_size": params["vocab_size"],
            # (Mistral's own code turns at 1e6 where the file names no base; a file without a length is taken
            # at 128k, as Mistral's recent models serve)
            "rope_theta": params.get("rope_theta") or 1e6, "sliding_window": params.get("sliding_window"),
            "max_position_embeddings": params.get("max_position_embeddings") or params.get("max_seq_len") or 128_000,
            "tie_word_embeddings": bool(params.get("tied_embeddings", False)), "hidden_act": "silu"}
    except KeyError as e:
        raise CheckpointError(f"Mistral params.json lacks {e}") from e
    return d if params.get("vision_encoder") is None else _image_text_config(d, params["vision_encoder"])


def _image_text_config(text: dict[str, Any], v: Mapping[str, Any]) -> dict[str, Any]:
    """The HF config transformers' converter makes of a text config and params.json's `vision_encoder`: Mistral 3
    with a patch merger (after its norm), or LLaVA over a Pixtral tower (vLLM's defaults where the file is
    silent: an adapter with biases, no merger); what neither takes is refused by name."""
    missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                           "patch_size") if k not in v]
    if missing:
        raise CheckpointError(f"Mistral params.json vision_encoder lacks {missing}")
    vision = {"model_type": "pixtral", "hidden_act": "silu", **{k: v[k] for k in _VISION_FIELDS if k in v}}
    vision.setdefault("image_size", v.get("max_image_size", 1024))
    top = {"text_config": text, "vision_config": vision, "image_token_index": v.get("image_token_id", 10),
           "projector_hidden_act": "gelu", "vision_feature_layer": -1,
           "tie_word_embeddings": text["tie_word_embeddings"]}
    merged = v.get("mm_projector_id") == "patch_merge"
    if merged and not v.get("add_pre_mm_projector_layer_norm"):
        raise UnsupportedModelError("a Mistral vision_encoder with a patch merger and no add_pre_mm_projector_layer_"
                                    "norm is not supported (Mistral 3's projector norms its input)")
    if merged:
        return {**top, "architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3",
                "spatial_merge_size": v.get("spatial_merge_size", 2),
                "multimodal_projector_bias": bool(v.get("adapter_bias", False))}
    other = {k: v[k] for k in ("mm_projector_id", "spatial_merge_size", "add_pre_mm_projector_layer_norm")
             if v.get(k) not in (None, "", 1, False)}
    if other:
        raise UnsupportedModelError(f"Mistral vision_encoder options {other} are not supported")
    return {**top, "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
            "vision_feature_select_strategy": "full", "multimodal_projector_bias": bool(v.get("adapter_bias", True))}


def image_processor_settings(path: str) -> dict[str, Any] | None:
    """The image processing of a Mistral-format image-text directory, which has no preprocessor_config.json:
    mistral_common's sizes, images scaled down to fit `max_image_size` (the tokenizer file's `image` settings, else
    params.json's encoder) with sides in whole patches, CLIP's mean and std, as `PixtralImageProcessor` settings
    (which resize with PIL's bicubic filter where mistral_common uses OpenCV's: a resized image's pixels differ a
    little; the grid of patches is the same); None for another directory."""
    params = os.path.join(path, PARAMS_FILE)
    if not os.path.isfile(params):
        return None
    with open(params) as f:
        v = json.load(f).get("vision_encoder")
    if not v:
        return None
    image: dict[str, Any] = {}
    if os.path.isfile(tekken := os.path.join(path, "tekken.json")):
        with open(tekken, encoding="utf-8") as f:
            image = json.load(f).get("image") or {}
    longest = image.get("max_image_size") or v.get("max_image_size") or v.get("image_size", 1024)
    return {"image_processor_type": "PixtralImageProcessor", "size": {"longest_edge": int(longest)},
            "patch_size": int(image.get("image_patch_size") or v["patch_size"]), "resample": 3}


def _half_split(w: np.ndarray, heads: int) -> np.ndarray:
    """A q or k projection [heads * head_dim, in] with each head's rows from interleaved rotary pairs into the
    half-split order (transformers' `permute` for Mistral's checkpoints)."""
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


class MistralDirectory(HFDirectory):
    """A Mistral-format directory opened for reading, as the HF directory it stands for."""

    def __init__(self, path: str | os.PathLike, weights: bool = True, overrides: Mapping[str, Any] | None = None):
        self.path = os.fspath(path)
        with open(os.path.join(self.path, PARAMS_FILE)) as f:
            self.params = json.load(f)
        self.hf_config = {**hf_config(self.params), **(overrides or {})}
        files = sorted(f for f in os.listdir(self.path) if f.startswith("consolidated") and f.endswith(".safetensors"))
        self.files = [os.path.join(self.path, f) for f in files] if weights else []

    def _hf_name(self, name: str) -> tuple[str | None, int | None]:
        """A stored tensor's HF name (None if unknown), and the heads whose q or k rows it holds in Mistral's
        interleaved order (None for any other tensor)."""
        text = self.hf_config.get("text_config", self.hf_config)
        vision_heads = self.hf_config.get("vision_config", {}).get("num_attention_heads")
        if (m := _LAYER.match(name)) is not None and m.group(2) in _NAMES:
            kind = m.group(2)
            rows = {"attention.wq.weight": text["num_attention_heads"],
                    "attention.wk.weight": text["num_key_value_heads"]}.get(kind)
            return f"model.layers.{m.group(1)}.{_NAMES[kind]}", rows
        if (v := _VISION_LAYER.match(name)) is not None and v.group(2) in _VISION_NAMES:
            rows = vision_heads if v.group(2) in ("attention.wq.weight", "attention.wk.weight") else None
            return f"vision_tower.transformer.layers.{v.group(1)}.{_VISION_NAMES[v.group(2)]}", rows
        return _TOP.get(name) or _VISION_TOP.get(name), None

    def _stored_tensors(self, select: Callable[[str], bool] | None = None) -> Iterator[tuple[str, np.ndarray]]:
        vision = "vision_config" in self.hf_config

        def wanted(name: str) -> bool:  # (read from disk only what `select` takes, and unknown names to refuse)
            if not vision and _VISION_PREFIX.match(name):
                return False  # (a vision encoder's tensors in a file whose params.json names none)
            hf = self._hf_name(name)[0]
            return hf is None or select is None or select(hf)

        for name, array in super()._stored_tensors(wanted):
            hf, rows = self._hf_name(name)
            if hf is None:
                raise CheckpointError(f"unknown tensor {name!r} in a Mistral-format checkpoint")
            yield hf, array if rows is None else _half_split(np.asarray(array), rows)
