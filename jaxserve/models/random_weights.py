"""Random weights of a model's shapes made on its devices (`--load-format dummy`)."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.models.params import Init, Params, _float_only, _is_info, declare_params


def random_params(cfg: ModelConfig, dtype: jnp.dtype, seed: int = 0, shardings: Params | None = None,
                  scale: float = 0.02) -> Params:
    """Random weights of `cfg`'s shapes, made on the device(s) in `dtype` (for `--load-format dummy`): normal(0,
    scale) matrices, unit norms, zero biases, leaf i drawn from fold_in(key(seed), i). With `shardings` (a tree of
    `NamedSharding`s, as `ShardingPlan.param_shardings`), each leaf is created directly in its shards, so no device
    ever holds a whole weight it does not keep."""
    _float_only(cfg)
    infos, treedef = jax.tree.flatten(declare_params(cfg), is_leaf=_is_info)
    targets = treedef.flatten_up_to(shardings) if shardings is not None else [None] * len(infos)
    key = jax.random.key(seed)
    leaves = [_random_leaf(info.shape, info.init, jnp.dtype(info.dtype or dtype), scale, target)(jax.random.fold_in(key, i))
              for i, (info, target) in enumerate(zip(infos, targets, strict=True))]
    return jax.tree.unflatten(treedef, leaves)


@functools.lru_cache(maxsize=256)
def _random_leaf(shape: tuple[int, ...], init: Init, dtype: jnp.dtype, scale: float, target: Any) -> Any:
    """The jitted maker of one random leaf (cached: a second model of the same shapes compiles nothing)."""
    def make(key: jax.Array) -> jax.Array:
        if init == "normal":
            return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
        return jnp.full(shape, 1.0 if init == "ones" else 0.0, dtype)

    return jax.jit(make, out_shardings=target)
