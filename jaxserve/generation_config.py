"""A model's sampling defaults from its `generation_config.json`, as vLLM's `--generation-config` reads them.

A request (over HTTP, or `LLM.generate` without sampling parameters) that leaves a sampling field out gets the
model's value instead of the API's: Qwen3 and Llama 3 checkpoints, for instance, ship a temperature and a top-p
their makers recommend. The fields read are those vLLM reads (`temperature`, `top_p`, `top_k`, `min_p`,
`repetition_penalty`, and `max_new_tokens`, which caps every request's `max_tokens`), each only where it differs
from the default of HF's `GenerationConfig` (a file that writes `top_k: 50` sets nothing). A GGUF file carries
them as llama.cpp's converter writes them from that file (`general.sampling.temp`, `.top_k`, `.top_p`, `.min_p`, `.penalty_repeat`).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any

from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
              "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
              "general.sampling.penalty_repeat": "repetition_penalty"}
# transformers' GenerationConfig defaults: a field equal to its default is not a choice the file made.
_HF_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None,
                                "repetition_penalty": 1.0, "max_new_tokens": None}


def sampling_defaults(model_path: str, generation_config: str = "auto",
                      overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The sampling defaults (`SamplingParams` field names; `max_tokens` a cap) for the model at `model_path`:
    `generation_config` "auto" reads its directory's `generation_config.json` (a GGUF file: its sampling
    metadata), "vllm" reads none, another value is a directory holding that file; `overrides` (vLLM's
    `--override-generation-config`) set fields over what was read."""
    if generation_config == "vllm":
        read: dict[str, Any] = {}
    elif generation_config == "auto" and os.path.isfile(model_path):
        read = _read_gguf(model_path)
    else:
        folder = model_path if generation_config == "auto" else generation_config
        path = os.path.join(folder, "generation_config.json")
        if generation_config != "auto" and not os.path.isfile(path):
            raise FileNotFoundError(f"generation_config {generation_config!r}: no generation_config.json there")
        read = _read(path) if os.path.isdir(folder) and os.path.isfile(path) else {}
    merged = {k: v for k, v in read.items() if k in _HF_DEFAULTS and v is not None and v != _HF_DEFAULTS[k]}
    for key, value in (overrides or {}).items():
        if key not in _HF_DEFAULTS:
            raise ValueError(f"override_generation_config: {key!r} is not a sampling default (one of "
                             f"{', '.join(_HF_DEFAULTS)})")
        merged[key] = value
    if "max_new_tokens" in merged:
        merged["max_tokens"] = merged.pop("max_new_tokens")
    SamplingParams(**merged)  # values a request could not give are refused here, named
    if merged:
        logger.info("sampling defaults from the model's generation config: %s (a request's own values win; "
                    "--generation-config vllm ignores them)", merged)
    return merged


def _read_gguf(path: str) -> dict[str, Any]:
    from jaxserve.loader.gguf_file import gguf_reader

    try:
        values = gguf_reader(path).values  # the loader's parse of the same file (cached)
    except Exception:  # noqa: BLE001 - not a GGUF file: the loader names that problem, not this
        return {}
    return {name: int(values[key]) if name == "top_k" else float(values[key])
            for key, name in _GGUF_KEYS.items() if key in values}


def _read(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data
