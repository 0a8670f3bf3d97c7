"""The runner's jitted step functions, shared by the runners of one process that serve the same model at the
same shapes.

A `jax.jit` object keeps its compiled executables in memory, keyed by its own identity. Building fresh ones for
each runner makes a second engine of the same model in one process (a prefill and a decode worker, an engine
restarted after `shutdown`, the tests' engines) trace, lower and look up every bucket again: about 16 s for
SmolLM2's nine buckets on two CPU cores, even with every executable in the persistent compilation cache. Runners
whose model config, runner config, model function and argument shapes and dtypes all agree get the same jit
objects instead, and their warmups find every bucket compiled.

The shared functions live while a runner uses them, and the last `KEEP_RELEASED` asked for stay a while
after: an engine rebuilt at the same shapes finds them. No more are kept, because compiled code is not small.
On the CPU, XLA loads each executable's compiled kernels into memory mappings of their own (code, constants
and data apart), and an engine of SmolLM2 at the tests' shapes holds about 10,000 of the 65,530 mappings Linux
allows a process by default (`vm.max_map_count`). Past that limit, loading one more executable crashes the
process.

Runners whose arrays are laid out over a mesh (`shardings`) build their own: their layouts are part of the jit.
Whatever a trace reads besides these keys (a module attribute patched in a test) is not part of the key;
`clear` forgets the shared functions.
"""

from __future__ import annotations

import functools
import inspect
import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax

logger = logging.getLogger(__name__)


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


KEEP_RELEASED = 2
"""How many of the most recently asked-for step functions are kept when no runner uses them."""

_live: weakref.WeakValueDictionary[tuple, StepFunctions] = weakref.WeakValueDictionary()
_recent: OrderedDict[tuple, StepFunctions] = OrderedDict()


def _shared(mixed_step, decode_loop, pool_step, model_cfg, cfg, model_fn, params_sig, kv_sig) -> StepFunctions:
    # The argument signatures are keys only: other shapes would compile into the shared functions after warmup.
    key = (mixed_step, decode_loop, pool_step, model_cfg, cfg, model_fn, params_sig, kv_sig)
    steps = _live.get(key)
    if steps is None:
        steps = _live[key] = _build(mixed_step, decode_loop, pool_step, model_cfg, cfg, model_fn, ({}, {}, {}))
    _recent[key] = steps
    _recent.move_to_end(key)
    while len(_recent) > KEEP_RELEASED:
        _recent.popitem(last=False)
    return steps


def clear() -> None:
    """Forget the shared step functions (their compiled executables go when no runner holds them)."""
    _recent.clear()
    _live.clear()


def _build(mixed_step, decode_loop, pool_step, model_cfg, cfg, model_fn, layouts) -> StepFunctions:
    mixed_layout, decode_layout, pool_layout = layouts
    hidden = "return_hidden" in inspect.signature(model_fn).parameters
    common = dict(cfg=model_cfg, backend=cfg.backend, model_fn=model_fn)
    sampled = dict(top_k=cfg.max_logprobs, logprobs_mode=cfg.logprobs_mode, keep_hidden=cfg.keep_hidden,
                   hidden_layers=cfg.hidden_layers)
    mixed = jax.jit(functools.partial(mixed_step, hidden=hidden, **sampled, **common),
                    donate_argnums=(1,), **mixed_layout)
    decode = jax.jit(functools.partial(decode_loop, n_max=cfg.num_scheduler_steps, **sampled, **common),
                     donate_argnums=(1,), **decode_layout)
    pool = jax.jit(functools.partial(pool_step, pooling_type=cfg.pooling_type, **common),
                   donate_argnums=(1,), **pool_layout) if cfg.pooling_type else None
    return StepFunctions(mixed, decode, pool, hidden)


def memory_mappings() -> tuple[int, int] | None:
    """(the memory mappings this process holds, the most Linux allows a process: `vm.max_map_count`), or None
    where /proc does not tell."""
    try:
        with open("/proc/self/maps", "rb") as f:
            used = sum(1 for _ in f)
        with open("/proc/sys/vm/max_map_count") as f:
            return used, int(f.read())
    except (OSError, ValueError):
        return None


MAPPINGS_WARN_FRACTION = 0.75


def warn_near_mapping_limit() -> None:
    """Logs a warning when the process holds more than `MAPPINGS_WARN_FRACTION` of the memory mappings it may."""
    counts = memory_mappings()
    if counts is not None and counts[0] > MAPPINGS_WARN_FRACTION * counts[1]:
        logger.warning("this process holds %d of the %d memory mappings Linux allows it (vm.max_map_count); "
                       "compiled executables take many on the CPU, and past the limit loading one more crashes "
                       "the process: raise it (sysctl -w vm.max_map_count=262144) or compile fewer shapes",
                       *counts)
