"""Mistral's own checkpoint format: a directory of `params.json`, `consolidated*.safetensors` and (for the tokenizer)
`tekken.json`, as Mistral publishes its models (some, such as Mistral Small 3.2, Magistral and Devstral, only so).

The directory is read as the HF Mistral model it is: `params.json` gives the config (`hf_config`), each tensor
its HF name (`layers.{i}.attention.wq.weight` -> `model.layers.{i}.self_attn.q_proj.weight`, ...), and the q and
k projections' rows are reordered from the interleaved rotary pairs Mistral's code turns (dims 2i and 2i + 1)
into the half-split order the model turns (dims i and i + head_dim / 2), as transformers' converter does. A
vision encoder's tensors are not read (the language model is served as text). Experts (`moe`), YaRN scaling and
other options of newer files are refused by name.
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
_VISION = re.compile(r"^(vision_encoder|vision_language_adapter|patch_merger|pre_mm_projector_norm)\.")
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
    return d


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

    def _stored_tensors(self, select: Callable[[str], bool] | None = None) -> Iterator[tuple[str, np.ndarray]]:
        heads = {"wq": self.hf_config["num_attention_heads"], "wk": self.hf_config["num_key_value_heads"]}
        for name, array in super()._stored_tensors(lambda n: not _VISION.match(n)):
            hf = _TOP.get(name)
            m = _LAYER.match(name)
            if m is not None and m.group(2) in _NAMES:
                hf = f"model.layers.{m.group(1)}.{_NAMES[m.group(2)]}"
                kind = m.group(2).split(".")[1]
                if kind in heads:
                    array = _half_split(np.asarray(array), heads[kind])
            if hf is None:
                raise CheckpointError(f"unknown tensor {name!r} in a Mistral-format checkpoint")
            if select is None or select(hf):
                yield hf, array
