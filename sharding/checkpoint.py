"""Converted weights saved and restored with orbax-checkpoint, each device reading only its shards.

A first start converts the original checkpoint (GGUF dequantization, HF transposes, KV head
repetition) and may save the result; later starts restore it straight into the plan's layout,
skipping the conversion. The directory holds the orbax tree and the model config it was made for.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax

from jaxserve.config import ModelConfig
from jaxserve.models.params import Params

CONFIG_FILE = "jaxserve_config.json"
PARAMS_DIR = "params"


def save_params(path: str | os.PathLike, params: Params, cfg: ModelConfig) -> None:
    """Write `params` (laid out for `cfg`, sharded or not) under `path`; every process calls this."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    os.makedirs(path, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(path, PARAMS_DIR), params)
    if jax.process_index() == 0:
        with open(os.path.join(path, CONFIG_FILE), "w") as f:
            json.dump({"config": cfg.to_hf(), "num_kv_heads": cfg.num_kv_heads}, f)


def saved_config(path: str | os.PathLike) -> ModelConfig | None:
    """The config a saved directory was made for, or None when there is none."""
    file = os.path.join(os.fspath(path), CONFIG_FILE)
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        d = json.load(f)
    import dataclasses

    return dataclasses.replace(ModelConfig.from_hf(d["config"]), num_kv_heads=d["num_kv_heads"])


def restore_params(path: str | os.PathLike, plan: Any, dtype: Any) -> Params:
    """Read saved parameters directly into `plan`'s shardings (each device reads its own slices).

    Refuses a directory saved for a different model config than the plan runs."""
    import orbax.checkpoint as ocp

    from jaxserve.models.params import abstract_params

    path = os.path.abspath(os.fspath(path))
    cfg = saved_config(path)
    if cfg != plan.model_cfg:
        raise ValueError(f"{path} holds parameters for {cfg}, not for the planned {plan.model_cfg}")
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract_params(plan.model_cfg, dtype), plan.param_shardings())
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(os.path.join(path, PARAMS_DIR), target)
