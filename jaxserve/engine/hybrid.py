"""Serving a hybrid model (Mamba-2 layers beside attention: `ModelConfig.mamba`): a state slot per running request,
a backup slot each for speculative decoding's rejected drafts, snapshot slots for the prefix cache (`state_cache`),
and the drafters not served with one (MTP's but for Qwen3-Next's and Qwen3.5's own layer), refused by name."""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.config_qwen3_next import GATED_DELTA_FAMILIES
from jaxserve.engine_args import EngineArgs
from jaxserve.errors import UnsupportedModelError
from jaxserve.models.inputs import KVCache

logger = logging.getLogger(__name__)


def hybrid_args(args: EngineArgs, cfg: ModelConfig) -> EngineArgs:
    """`args` for serving `cfg`: for a hybrid model, what it cannot serve refused, drafts verified as chunks (rows of
    one token each would all read the same states), and no prefix caching where no Mamba states are kept for it (a
    cached prefix's pages alone leave its Mamba layers' states unknown)."""
    if cfg.mamba is None:
        return args
    spec = args.speculative_config
    mtp = spec is not None and spec.method == "mtp" and cfg.family in GATED_DELTA_FAMILIES  # (its own MTP layer)
    if spec is not None and spec.method not in ("ngram", "suffix", "draft_model", "eagle", "eagle3") and not mtp:
        raise UnsupportedModelError(f"speculative decoding by {spec.method} is not supported for a hybrid (Mamba) "
                                    "model (ngram, suffix, draft-model and EAGLE drafts are; Qwen3-Next's and "
                                    "Qwen3.5's MTP layer too)")
    if spec is not None and not spec.chunked:
        args = dataclasses.replace(args, speculative_config=dataclasses.replace(spec, draft_verification="chunks"))
    if args.is_pooling:
        raise UnsupportedModelError("runner 'pooling' is not supported for a hybrid (Mamba) model")
    if args.enable_prefix_caching and args.max_mamba_cache_size == 0:
        logger.info("prefix caching is off: --max-mamba-cache-size 0 keeps no Mamba states for it")
        args = dataclasses.replace(args, enable_prefix_caching=False)
    return args


def backup_slot(slot: int, max_num_seqs: int) -> int:
    """Where a drafted request's states wait out the step that verifies its drafts (`back_up_drafted`): put back
    when a draft is rejected (`roll_back_rejected`), the states having run through it."""
    return slot + max_num_seqs


@dataclass(frozen=True)
class StateLayout:
    """A hybrid model's state pools (all zero without states): slot 0, which the padding writes, and one slot per
    running request (`running` slots in all); with speculative decoding, a backup slot each after those
    (`backup_slot`); then the prefix cache's `snapshots` (`state_cache`), from `first_snapshot`. The convolution's
    and the SSM's `dtypes`; the pools' `bytes`, taken from the KV cache's budget."""

    running: int
    snapshots: int
    first_snapshot: int
    dtypes: tuple[np.dtype, np.dtype]
    bytes: int

    @property
    def slots(self) -> int:
        return self.first_snapshot + self.snapshots


def state_layout(cfg: ModelConfig, args: EngineArgs, model_dtype) -> StateLayout:
    """`cfg`'s state pools as `args` size them: float32 unless `--mamba-cache-dtype` (auto: the model's dtype) or
    the SSM's `--mamba-ssm-cache-dtype` (auto: as the other) say otherwise."""
    conv = np.dtype(model_dtype if args.mamba_cache_dtype == "auto" else jnp.dtype(args.mamba_cache_dtype))
    dtypes = conv, conv if args.mamba_ssm_cache_dtype == "auto" else np.dtype(jnp.dtype(args.mamba_ssm_cache_dtype))
    if cfg.mamba is None:
        return StateLayout(0, 0, 0, dtypes, 0)
    running = 1 + args.max_num_seqs
    first = running + (args.max_num_seqs if args.speculative_config is not None else 0)
    snapshots = (args.max_num_seqs if args.max_mamba_cache_size is None else args.max_mamba_cache_size
                 ) if args.enable_prefix_caching else 0
    shapes = KVCache.state_shapes(cfg, first + snapshots)
    size = sum(math.prod(shapes[name]) * t.itemsize for name, t in zip(("conv", "ssm"), dtypes, strict=True))
    return StateLayout(running, snapshots, first, dtypes, size)


def back_up_drafted(engine, spec) -> None:
    """Before a step verifies drafts (`speculative.SpecStep`): each drafted request's states copied to its backup
    slot (an `LLMEngine` serving a hybrid model)."""
    if spec is not None and engine.scheduler.states is not None and any(spec.drafts.values()):
        slots = [engine.scheduler.get_request(rid).state_slot for rid, d in spec.drafts.items() if d]
        engine.runner.copy_states([(s, backup_slot(s, engine.args.max_num_seqs)) for s in slots])


def roll_back_rejected(engine, spec) -> None:
    """After that step: a request that did not take all its drafts gets its states back from before the step and
    computes the tokens it took again (its states ran through the rejected ones)."""
    if spec is None or engine.scheduler.states is None:
        return
    start: dict[str, int] = {}
    for s in spec.rows:
        start.setdefault(s.request_id, s.start_position)
    for rid, drafts in spec.drafts.items():
        r = engine.scheduler.get_request(rid)
        if drafts and r is not None and r.state_slot and r.num_computed_tokens != start[rid] + len(drafts) + 1:
            engine.scheduler.roll_back(r, start[rid], backup_slot(r.state_slot, engine.args.max_num_seqs))
