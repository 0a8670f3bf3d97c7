"""Converted weights saved and restored with orbax-checkpoint, each device reading only its shards.

A first start converts the original checkpoint (GGUF dequantization, HF transposes, KV head
repetition) and saves the result; later starts restore it straight into the plan's layout,
skipping the conversion (`--converted-checkpoint-dir`). The directory holds the orbax tree and,
written last, what it was made for: the model config, the dtype and the source checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.models.params import Params

CONFIG_FILE = "jaxserve_config.json"
PARAMS_DIR = "params"


class ConvertedCheckpointMismatch(ValueError):
    """A converted-checkpoint directory made for another model, dtype or source than this start's."""


@dataclass(frozen=True)
class SavedInfo:
    """What a converted-checkpoint directory was made for."""

    config: ModelConfig
    dtype: str | None  # None in directories written before the dtype was recorded
    source: dict[str, Any] | None  # e.g. the original checkpoint's name and size


def save_params(path: str | os.PathLike, params: Params, cfg: ModelConfig,
                source: dict[str, Any] | None = None) -> None:
    """Write `params` (laid out for `cfg`, sharded or not) under `path`; every process calls this.

    `source` (JSON) describes the checkpoint they were converted from, checked again at restore.
    The description file is written after the tree, so a save cut short reads as no save at all.
    """
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    os.makedirs(path, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        # force: a save that died half-way left a tree without its description; write over it.
        ckptr.save(os.path.join(path, PARAMS_DIR), params, force=True)
    if jax.process_index() == 0:
        dtype = jnp.dtype(jax.tree.leaves(params)[0].dtype).name
        info = {"config": cfg.to_hf(), "num_kv_heads": cfg.num_kv_heads, "weight_quant": cfg.weight_quant,
                "dtype": dtype, "source": source}
        tmp = os.path.join(path, CONFIG_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump(info, f)
        os.replace(tmp, os.path.join(path, CONFIG_FILE))


def saved_info(path: str | os.PathLike) -> SavedInfo | None:
    """What a saved directory was made for, or None when it holds no complete save."""
    file = os.path.join(os.fspath(path), CONFIG_FILE)
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        d = json.load(f)
    cfg = dataclasses.replace(ModelConfig.from_hf(d["config"]), num_kv_heads=d["num_kv_heads"],
                              weight_quant=d.get("weight_quant"))
    return SavedInfo(cfg, d.get("dtype"), d.get("source"))


def saved_config(path: str | os.PathLike) -> ModelConfig | None:
    """The config a saved directory was made for, or None when there is none."""
    info = saved_info(path)
    return info.config if info is not None else None


def check_saved(path: str | os.PathLike, cfg: ModelConfig, dtype: Any, source: dict[str, Any] | None = None) -> None:
    """Raise `ConvertedCheckpointMismatch`, naming what differs, unless `path` was saved for `cfg` in `dtype`
    (and from `source`, when both this call and the save name one)."""
    path = os.path.abspath(os.fspath(path))
    info = saved_info(path)
    if info is None:
        raise FileNotFoundError(f"{path} holds no saved parameters ({CONFIG_FILE} is missing)")
    hint = "; point --converted-checkpoint-dir elsewhere or delete the directory"
    if info.config != cfg:
        diff = ", ".join(f"{f.name}={getattr(info.config, f.name)!r} (needed {getattr(cfg, f.name)!r})"
                         for f in dataclasses.fields(cfg) if getattr(info.config, f.name) != getattr(cfg, f.name))
        raise ConvertedCheckpointMismatch(f"{path} holds parameters for another model config, not for the planned one: {diff}{hint}")
    want = jnp.dtype(dtype).name
    if info.dtype is not None and info.dtype != want:
        raise ConvertedCheckpointMismatch(f"{path} holds {info.dtype} parameters, this start needs {want}{hint}")
    if source is not None and info.source is not None and info.source != source:
        raise ConvertedCheckpointMismatch(f"{path} was converted from {info.source}, not from {source}{hint}")


def restore_params(path: str | os.PathLike, plan: Any, dtype: Any, cfg: ModelConfig | None = None,
                   source: dict[str, Any] | None = None) -> Params:
    """Read saved parameters directly into `plan`'s shardings (each device reads its own slices).

    With `plan` None they go to the first device, laid out for `cfg`. Refuses (`ConvertedCheckpointMismatch`)
    a directory saved for a different model config, dtype or source than this start's."""
    import orbax.checkpoint as ocp

    from jaxserve.models.params import abstract_params

    path = os.path.abspath(os.fspath(path))
    cfg = plan.model_cfg if plan is not None else cfg
    if cfg is None:
        raise ValueError("restore_params needs a sharding plan or the model config")
    check_saved(path, cfg, dtype, source)
    if plan is not None:
        shardings = plan.param_shardings()
    else:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: one, abstract_params(cfg, dtype))
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract_params(cfg, dtype), shardings)
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(os.path.join(path, PARAMS_DIR), target)
