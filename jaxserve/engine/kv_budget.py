"""The KV cache's size: the pages that fit its budget (`kv_cache_pages`) and the longest sequence they serve
(`max_model_length`)."""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.engine_args import EngineArgs
from jaxserve.models.inputs import KVCache

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 2 << 30


def kv_cache_pages(args: EngineArgs, cfg: ModelConfig, dtype: Any, weight_bytes: int, kv_shards: int = 1,
                   beside: tuple[int, int] = (0, 0), states: int = 0) -> int:
    """Pages that fit the KV budget: `kv_cache_memory_bytes` (all devices together), else a share of
    one device's memory; `weight_bytes` is one device's weights, `kv_shards` the devices a page is split over,
    `beside` the weights and the bytes a page of another model served beside this one (a draft model's pool of
    the same pages); `states` the bytes of a hybrid model's states, which a budget given or a device's share holds
    beside the pages (the CPU's default pages come on top of them); a model without attention's as it needs."""
    weight_bytes += beside[0]
    per_page = KVCache.bytes_per_page(cfg, args.page_size, dtype) + beside[1]
    budget = args.kv_cache_memory_bytes
    if budget is None:
        device = jax.devices()[0]
        stats = device.memory_stats() if device.platform != "cpu" else None
        if stats and "bytes_limit" in stats:
            budget = int(stats["bytes_limit"] * args.gpu_memory_utilization) - weight_bytes
            # Activations and sampling buffers need room too.
            budget = int(budget * 0.9) * kv_shards  # every device holds 1 / kv_shards of each page
        else:
            budget = CPU_DEFAULT_KV_BYTES + states * kv_shards
    if per_page == 0:  # (no attention: the pages hold nothing)
        return attention_free_pages(args, cfg, budget, states * kv_shards)
    pages = (budget - states * kv_shards) // per_page  # (a hybrid model's states are whole on every device)
    if pages < 2:
        of_states = f", {states * kv_shards} of them the Mamba states" if states else ""
        raise ValueError(f"the KV cache budget ({budget} bytes{of_states}) holds no two pages of {per_page} bytes; "
                         "raise --kv-cache-memory-bytes or --gpu-memory-utilization")
    logger.info("KV cache: %d pages of %d tokens (%d tokens) in %s, %.1f MiB", pages, args.page_size,
                pages * args.page_size, jnp.dtype(dtype).name, pages * per_page / 2**20)
    return int(pages)


def attention_free_pages(args: EngineArgs, cfg: ModelConfig, budget: int, states: int) -> int:
    """The page pool of a model without attention (Mamba's; `kv_cache_pages`): its pages hold nothing, they count its
    tokens, as many as twice `max_num_seqs` sequences of the longest length (the prefix cache's beside the running
    ones'); its `states` bytes take the KV cache's `budget`."""
    if states > budget:
        raise ValueError(f"the KV cache budget ({budget} bytes) does not hold the Mamba states ({states} bytes); "
                         "raise --kv-cache-memory-bytes or --gpu-memory-utilization, or lower --max-num-seqs or "
                         "--max-mamba-cache-size")
    return 1 + 2 * args.max_num_seqs * -(-(args.max_model_len or cfg.max_position_embeddings) // args.page_size)


def max_model_length(args: EngineArgs, cfg: ModelConfig, num_pages: int) -> int:
    """The longest sequence the engine serves: `max_model_len`, checked against the model's context and the
    pool (page 0 is reserved), or the most of both."""
    usable_tokens = (num_pages - 1) * args.page_size
    max_model_len = args.max_model_len or min(cfg.max_position_embeddings, usable_tokens)
    if max_model_len > cfg.max_position_embeddings:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's context length "
                         f"{cfg.max_position_embeddings}")
    if max_model_len > usable_tokens:
        raise ValueError(
            f"max_model_len {max_model_len} needs more KV cache than the {usable_tokens} tokens of the pool; "
            "raise --kv-cache-memory-bytes or lower --max-model-len"
        )
    return max_model_len
