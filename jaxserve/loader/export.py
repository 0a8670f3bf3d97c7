"""`jaxserve convert`: write the very weights jaxserve serves as an HF model directory."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.loader.keymap import hf_tensors
from jaxserve.models.params import Params, param_paths
from jaxserve.models.quantized import dequantize

MAX_SHARD_BYTES = 2 << 30


def export_hf(out_dir: str, cfg: ModelConfig, params: Params | None, tokenizer: Any,
              dtype: str = "float32", vision: Any = None) -> list[str]:
    """Write config.json, safetensors (sharded past 2 GiB, with an index), tokenizer files and
    the chat template to `out_dir`; returns the files written (tokenizer files aside). Without
    `params`, no weights: a directory for `--load-format dummy`. With `vision` (an image-text model's
    `multimodal.ImageEncoder`), the whole model: its language model as the family's checkpoints hold it, the
    vision tower, the projector, the source's config around the language model's, and the image processor's config."""
    os.makedirs(out_dir, exist_ok=True)
    written = [] if params is None else _write_weights(out_dir, cfg, params, dtype, vision)
    config = cfg.to_hf()
    if vision is not None:  # the weights written are dequantized: the source's quantization goes
        outer = {k: v for k, v in vision.hf_config.items() if k != "quantization_config"}
        config = {**outer, "text_config": config}
    config["torch_dtype"] = dtype
    config["bos_token_id"] = tokenizer.bos_token_id
    eos = list(tokenizer.eos_token_ids)
    config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    # The tokenizer's (None: none), not the family's default (GLM's config class names an id past a small vocabulary).
    config["pad_token_id"] = tokenizer.pad_token_id
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    written.append(os.path.join(out_dir, "config.json"))
    gen_path = os.path.join(out_dir, "generation_config.json")
    if not os.path.exists(gen_path):
        with open(gen_path, "w") as f:
            json.dump({"bos_token_id": tokenizer.bos_token_id, "eos_token_id": config["eos_token_id"]}, f, indent=2)
    tokenizer.save_hf(out_dir)
    if vision is not None:
        with open(os.path.join(out_dir, "preprocessor_config.json"), "w") as f:
            json.dump(vision.processor_config, f, indent=2)
    return written


def _write_weights(out_dir: str, cfg: ModelConfig, params: Params, dtype: str, vision: Any) -> list[str]:
    import ml_dtypes
    from safetensors.numpy import save_file

    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    # (weights held quantized are written dequantized, as a quantized checkpoint's weights are read)
    flat = {k: np.asarray(v) for k, v in param_paths(dequantize(params, np.float32)).items()}
    tensors = hf_tensors(cfg, flat)
    if vision is not None:  # the Hub's layout of the model's family
        tensors = vision.checkpoint_tensors(tensors)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, t in tensors:
        scale = name.endswith(("self_attn.k_scale", "self_attn.v_scale"))  # stays float32
        t = np.require(t.astype(np.float32 if scale else np_dtype), requirements="C")  # (a scalar stays 0-d)
        if size and size + t.nbytes > MAX_SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    written = []
    if len(shards) == 1:
        path = os.path.join(out_dir, "model.safetensors")
        save_file(shards[0], path, metadata={"format": "pt"})
        written.append(path)
    else:
        weight_map = {}
        total = 0
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
            written.append(os.path.join(out_dir, fname))
            for name, t in shard.items():
                weight_map[name] = fname
                total += t.nbytes
        index = os.path.join(out_dir, "model.safetensors.index.json")
        with open(index, "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        written.append(index)
    return written
