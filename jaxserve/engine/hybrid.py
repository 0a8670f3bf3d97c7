"""Serving a hybrid model (Mamba-2 layers beside attention: `ModelConfig.mamba`): a state slot per running request,
and the features that a per-sequence recurrent state rules out, refused by name."""

from __future__ import annotations

import dataclasses
import logging
import math

from jaxserve.config import ModelConfig
from jaxserve.engine_args import EngineArgs
from jaxserve.errors import UnsupportedModelError
from jaxserve.models.inputs import KVCache

logger = logging.getLogger(__name__)


def hybrid_args(args: EngineArgs, cfg: ModelConfig) -> EngineArgs:
    """`args` for serving `cfg`: a hybrid model's without prefix caching (its states are not per page: a cached
    prefix's pages would leave its Mamba layers' states unknown); features it cannot serve refused."""
    if cfg.mamba is None:
        return args
    refused = (("speculative_config", "speculative decoding (its rejected drafts would have advanced the states)"),
               ("enable_lora", "LoRA adapters"), ("enable_prompt_embeds", "prompt embeddings"),
               ("calculate_kv_scales", "calculated float8 KV scales"))
    for name, what in refused:
        if getattr(args, name, None):
            raise UnsupportedModelError(f"{what} ({name}) is not supported for a hybrid (Mamba) model")
    if args.is_pooling:
        raise UnsupportedModelError("runner 'pooling' is not supported for a hybrid (Mamba) model")
    if args.enable_prefix_caching:
        logger.info("prefix caching is off: a hybrid model's Mamba states are not per page")
        args = dataclasses.replace(args, enable_prefix_caching=False)
    return args


def state_slots(cfg: ModelConfig, max_num_seqs: int) -> int:
    """The state pools' slots: one per running request and slot 0, which the padding writes (0 without states)."""
    return 0 if cfg.mamba is None else max_num_seqs + 1


def state_bytes(cfg: ModelConfig, max_num_seqs: int) -> int:
    """The state pools' bytes (float32), taken from the KV cache's budget."""
    return 4 * sum(math.prod(s) for s in KVCache.state_shapes(cfg, state_slots(cfg, max_num_seqs)).values())
