"""Loading a model for the engine: config, weights on the device, tokenizer, KV pool size."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.engine_args import EngineArgs
from jaxserve.loader import GGUFFile, load_params, model_display_name, open_checkpoint, resolve_model
from jaxserve.models.inputs import KVCache
from jaxserve.models.llama import forward
from jaxserve.models.params import Params
from jaxserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 2 << 30


@dataclass
class LoadedModel:
    path: str
    name: str
    config: ModelConfig
    params: Params
    tokenizer: Tokenizer
    dtype: Any
    load_seconds: float
    forward_fn: Callable = forward
    """The model step `forward(params, kv, inputs, cfg, backend) -> (logits, kv)`."""


def resolve_dtype(args: EngineArgs) -> Any:
    if args.dtype == "float32":
        return jnp.float32
    if args.dtype == "bfloat16":
        return jnp.bfloat16
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def enable_compile_cache(path: str | None) -> None:
    """Keep compiled executables on disk so later starts skip most of the warmup compile."""
    if not path or jax.config.jax_compilation_cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def load_model(args: EngineArgs, progress: bool = True) -> LoadedModel:
    """Read the checkpoint named by `args.model` (None = bundled SmolLM2) onto the default device."""
    t0 = time.perf_counter()
    path = resolve_model(args.model)
    ckpt = open_checkpoint(path)
    cfg = ckpt.config()
    dtype = resolve_dtype(args)
    if isinstance(ckpt, GGUFFile):
        tokenizer = Tokenizer.from_gguf(ckpt.reader)
    else:
        tokenizer = Tokenizer.from_hf_dir(path)
    params = load_params(ckpt, cfg, dtype, progress=progress)
    return LoadedModel(path, model_display_name(path), cfg, params, tokenizer, dtype, time.perf_counter() - t0)


def kv_cache_pages(args: EngineArgs, cfg: ModelConfig, dtype: Any, weight_bytes: int) -> int:
    """Pages that fit the KV budget: `kv_cache_memory_bytes`, else a share of device memory."""
    per_page = KVCache.bytes_per_page(cfg, args.page_size, dtype)
    budget = args.kv_cache_memory_bytes
    if budget is None:
        device = jax.devices()[0]
        stats = device.memory_stats() if device.platform != "cpu" else None
        if stats and "bytes_limit" in stats:
            budget = int(stats["bytes_limit"] * args.gpu_memory_utilization) - weight_bytes
            # Activations and sampling buffers need room too.
            budget = int(budget * 0.9)
        else:
            budget = CPU_DEFAULT_KV_BYTES
    pages = budget // per_page
    if pages < 2:
        raise ValueError(
            f"the KV cache budget ({budget} bytes) holds no pages of {per_page} bytes; raise "
            "--kv-cache-memory-bytes or --gpu-memory-utilization"
        )
    return int(pages)


def params_bytes(params: Params) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
