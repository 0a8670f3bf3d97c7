"""Serving a hybrid model (Mamba-2 layers beside attention: `ModelConfig.mamba`): a state slot per running request,
snapshot slots for the prefix cache (`state_cache`), and the features that a per-sequence recurrent state rules out,
refused by name."""

from __future__ import annotations

import dataclasses
import logging
import math

import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.engine_args import EngineArgs
from jaxserve.errors import UnsupportedModelError
from jaxserve.models.inputs import KVCache

logger = logging.getLogger(__name__)


def hybrid_args(args: EngineArgs, cfg: ModelConfig) -> EngineArgs:
    """`args` for serving `cfg`: a hybrid model's features it cannot serve refused; without prefix caching where no
    Mamba states are kept for it (a cached prefix's pages alone leave its Mamba layers' states unknown)."""
    if cfg.mamba is None:
        return args
    if args.speculative_config is not None:
        raise UnsupportedModelError("speculative decoding (speculative_config) is not supported for a hybrid (Mamba) "
                                    "model: its rejected drafts would have advanced the Mamba states")
    if args.is_pooling:
        raise UnsupportedModelError("runner 'pooling' is not supported for a hybrid (Mamba) model")
    if args.enable_prefix_caching and args.max_mamba_cache_size == 0:
        logger.info("prefix caching is off: --max-mamba-cache-size 0 keeps no Mamba states for it")
        args = dataclasses.replace(args, enable_prefix_caching=False)
    return args


def state_slots(cfg: ModelConfig, max_num_seqs: int) -> int:
    """The state pools' slots for running requests: one each and slot 0, which the padding writes (0 without
    states)."""
    return 0 if cfg.mamba is None else max_num_seqs + 1


def state_snapshots(cfg: ModelConfig, args: EngineArgs) -> int:
    """The state pools' slots after those for the prefix cache's snapshots (`state_cache`; 0 without)."""
    if cfg.mamba is None or not args.enable_prefix_caching:
        return 0
    return args.max_num_seqs if args.max_mamba_cache_size is None else args.max_mamba_cache_size


def state_dtypes(args: EngineArgs, model_dtype) -> tuple[np.dtype, np.dtype]:
    """The convolution's and the SSM's state dtypes: `--mamba-cache-dtype` (auto: the model's), the SSM's
    `--mamba-ssm-cache-dtype` where that is not auto."""
    conv = np.dtype(model_dtype if args.mamba_cache_dtype == "auto" else jnp.dtype(args.mamba_cache_dtype))
    return conv, conv if args.mamba_ssm_cache_dtype == "auto" else np.dtype(jnp.dtype(args.mamba_ssm_cache_dtype))


def state_bytes(cfg: ModelConfig, args: EngineArgs, model_dtype) -> int:
    """The state pools' bytes, taken from the KV cache's budget."""
    slots = state_slots(cfg, args.max_num_seqs) + state_snapshots(cfg, args)
    shapes = KVCache.state_shapes(cfg, slots)
    return sum(math.prod(shapes[name]) * t.itemsize
               for name, t in zip(("conv", "ssm"), state_dtypes(args, model_dtype), strict=True) if name in shapes)
