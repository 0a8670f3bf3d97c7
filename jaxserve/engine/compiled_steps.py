"""The runner's jitted step functions, shared by the runners of one process that serve the same model at the
same shapes.

A `jax.jit` object keeps its compiled executables in memory, keyed by its own identity. Building fresh ones for
each runner makes a second engine of the same model in one process (a prefill and a decode worker, an engine
restarted after `shutdown`, the tests' engines) trace, lower and look up every bucket again: about 16 s for
SmolLM2's nine buckets on two CPU cores, even with every executable in the persistent compilation cache. Runners
whose model config, runner config, model function and argument shapes and dtypes all agree get the same jit
objects instead, and their warmups find every bucket compiled.

Runners whose arrays are laid out over a mesh (`shardings`) build their own: their layouts are part of the jit.
Whatever a trace reads besides these keys (a module attribute patched in a test) is not part of the key;
`clear` forgets the shared functions.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax


@dataclass(frozen=True)
class StepFunctions:
    mixed: Callable
    decode: Callable
    pool: Callable | None
    hidden: bool
    """Whether the model function returns its hidden states (prompt logprobs need them)."""


def _signature(tree: Any) -> tuple:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((tuple(a.shape), str(a.dtype)) for a in leaves)


def step_functions(mixed_step, decode_loop, pool_step, model_cfg, cfg, params, kv, model_fn,
                   shardings=None) -> StepFunctions:
    """The jitted `mixed_step`, `decode_loop` and (for a pooling model) `pool_step` of a runner; `cfg`: its
    `RunnerConfig`. The page pool (argument 1) is donated."""
    if shardings is not None:
        rep = shardings.replicated
        params_layout = jax.tree.map(lambda a: a.sharding, params)
        layouts = (dict(in_shardings=(params_layout, shardings.kv, rep, rep, rep, rep, rep),
                        out_shardings=(rep, shardings.kv)),
                   dict(in_shardings=(params_layout, shardings.kv, rep, rep, rep, rep),
                        out_shardings=(rep, shardings.kv)),
                   dict(in_shardings=(params_layout, shardings.kv, rep), out_shardings=(rep, shardings.kv)))
        return _build(mixed_step, decode_loop, pool_step, model_cfg, cfg, model_fn, layouts)
    return _shared(mixed_step, decode_loop, pool_step, model_cfg, cfg, model_fn, _signature(params), _signature(kv))


@functools.lru_cache(maxsize=8)
def _shared(mixed_step, decode_loop, pool_step, model_cfg, cfg, model_fn, params_sig, kv_sig) -> StepFunctions:
    del params_sig, kv_sig  # keys only: other shapes would compile into the shared functions after warmup
    return _build(mixed_step, decode_loop, pool_step, model_cfg, cfg, model_fn, ({}, {}, {}))


def clear() -> None:
    """Forget the shared step functions (and so their compiled executables)."""
    _shared.cache_clear()


def _build(mixed_step, decode_loop, pool_step, model_cfg, cfg, model_fn, layouts) -> StepFunctions:
    mixed_layout, decode_layout, pool_layout = layouts
    hidden = "return_hidden" in inspect.signature(model_fn).parameters
    common = dict(cfg=model_cfg, backend=cfg.backend, model_fn=model_fn)
    mixed = jax.jit(functools.partial(mixed_step, top_k=cfg.max_logprobs, hidden=hidden, **common),
                    donate_argnums=(1,), **mixed_layout)
    decode = jax.jit(functools.partial(decode_loop, top_k=cfg.max_logprobs, n_max=cfg.num_scheduler_steps,
                                       **common), donate_argnums=(1,), **decode_layout)
    pool = jax.jit(functools.partial(pool_step, pooling_type=cfg.pooling_type, **common),
                   donate_argnums=(1,), **pool_layout) if cfg.pooling_type else None
    return StepFunctions(mixed, decode, pool, hidden)
