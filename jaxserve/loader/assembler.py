"""Collecting a checkpoint's tensors into the declared parameters, each checked as it comes (`keymap` names them)."""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.config_families import WEIGHTLESS_NORM_FAMILIES
from jaxserve.loader.falcon_keys import falcon_folded
from jaxserve.loader.gpt2_keys import LAYOUTS, own_tensors
from jaxserve.loader.keymap import (
    KV_SCALE_PATHS,
    CheckpointError,
    Target,
    canonical_name,
    hf_names,
    hf_target,
    split_packed,
)
from jaxserve.loader.mimo_keys import mimo_uniform
from jaxserve.loader.olmo_hybrid_keys import CONV_RE, joined_conv
from jaxserve.loader.quantized_keys import kept_module, projection_modules
from jaxserve.models.params import ParamInfo, Params, declare_params, from_param_paths, param_paths
from jaxserve.models.quantized import QuantizedWeight, quantize

# Stacks a checkpoint may leave whole, and what their rows hold where no tensor lands: MiMo-V2-Flash's full layers have
# no sinks (-inf: none). Any other stack's rows no tensor lands in are zeros (a hybrid layer without a mixer or an MLP
# leaves that part's norm row unread).
ABSENT_FILL = {"layers.sinks": -np.inf}


def _blank(path: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A stacked array before its checkpoint tensors land."""
    return np.full(shape, next((v for suffix, v in ABSENT_FILL.items() if path.endswith(suffix)), 0), dtype)


class WeightAssembler:
    """Collects checkpoint tensors into host arrays of the declared shapes, checking each one."""

    def __init__(self, cfg: ModelConfig, dtype: np.dtype):
        self.cfg = cfg
        self.dtype = np.dtype(dtype)
        self._decl = param_paths(declare_params(cfg))
        self._arrays: dict[str, np.ndarray] = {}
        self._seen: set[str] = set()
        self._held: dict[str, dict[str, np.ndarray]] = {}  # (parts of one parameter tensor, until all have come)

    def add(self, name: str, tensor: np.ndarray) -> None:
        """Place HF-named `tensor` (HF layout) into its parameter; refuses duplicates and wrong shapes. A weight
        held quantized (`kept_module`) comes as its stored values (`...weight`) and its scales broadcast to the
        weight's shape (`...weight_scale`); a float one is quantized here as at load."""
        if self.cfg.family in LAYOUTS and (parts := own_tensors(name, tensor, self.cfg)) is not None:  # (own names)
            for part_name, part in parts:
                self.add(part_name, part)
            return
        name = canonical_name(name, self.cfg)
        if self.cfg.family == "olmo_hybrid" and CONV_RE.match(name):  # (its q, k and v convolutions: one tensor)
            joined = joined_conv(self._held, name, tensor)
            if joined is None:
                return
            name, tensor = joined
        scale = name.endswith(".weight_scale")
        weight_name = name.removesuffix("_scale") if scale else name
        if self.cfg.family == "mimo_v2_flash":  # (its layers' heads and values made uniform)
            tensor = mimo_uniform(weight_name, tensor, self.cfg)
        if self.cfg.family == "falcon_h1":  # (its multipliers into its weights)
            tensor = falcon_folded(weight_name, tensor, self.cfg)
        parts = split_packed(weight_name, tensor, self.cfg)
        if parts is not None:
            for part_name, part in parts:
                self.add(part_name + ("_scale" if scale else ""), part)
            return
        target = hf_target(weight_name, self.cfg)
        if target is None:
            return
        if target.path == "lm_head" and self.cfg.tie_word_embeddings:
            return  # tied checkpoints may still carry a copy of the embedding
        if name in self._seen:
            raise CheckpointError(f"tensor {name!r} appears twice in the checkpoint")
        if target.path == "layers.xielu" and tensor.size == 1:  # (scalars, [] or [1] as they were saved)
            tensor = tensor.reshape(target.hf_shape)
        if target.path in KV_SCALE_PATHS and tensor.size == 1:
            tensor = tensor.reshape(())
            if not np.isfinite(tensor) or tensor <= 0:
                raise CheckpointError(f"tensor {name!r} is {float(tensor)}, a KV cache scale must be positive")
        if tuple(tensor.shape) != target.hf_shape:
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {target.hf_shape} for this config"
            )
        info = self._decl[target.path]
        if isinstance(info, QuantizedWeight):
            self._add_quantized(name, target, info, tensor, scale)
            return
        if scale:
            raise CheckpointError(f"tensor {name!r}: {weight_name} is held in float, not quantized")
        self._seen.add(name)
        dtype = np.dtype(np.float32) if target.path in KV_SCALE_PATHS else np.dtype(info.dtype or self.dtype)
        self._put(target, info, np.asarray(target.transform(tensor)).astype(dtype, copy=False))

    def _put(self, target: Target, info: ParamInfo, value: np.ndarray, part: str | None = None) -> None:
        """`value` into its place of `target`'s stacked array (of a quantized weight's `part`, "q" or "scale")."""
        if target.path not in self._arrays:
            self._arrays[target.path] = (_blank(target.path, info.shape, value.dtype) if part is None else
                                         QuantizedWeight(np.zeros(info.q.shape, info.q.dtype),
                                                         np.zeros(info.scale.shape, np.float32)))
        array = self._arrays[target.path]
        array = array if part is None else getattr(array, part)
        index = () if target.layer is None else (target.layer,) if target.expert is None else (
            target.layer, target.expert)
        array[(*index, ...) if target.cols is None else (*index, ..., slice(*target.cols))] = value

    def _add_quantized(self, name: str, target: Target, info: QuantizedWeight, tensor: np.ndarray,
                       scale: bool) -> None:
        # A scale is kept where its weight's input axes are: [..., 1, ...] of the transformed [N, K] broadcast.
        item = info.scale.shape[1 if target.expert is None else 2:]
        keep = tuple(slice(0, 1) if n == 1 else slice(None) for n in item)
        value = np.asarray(target.transform(tensor))
        self._seen.add(name)
        if scale:
            self._put(target, info, np.asarray(value[keep], np.float32), "scale")
        elif value.dtype == info.q.dtype:
            self._put(target, info, value, "q")
        elif value.dtype in (np.int8, np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)):
            raise CheckpointError(f"tensor {name!r} is {value.dtype}; the model holds it as {info.q.dtype}")
        else:  # a projection the checkpoint left in float (its quantization config ignores it): quantized here
            axes = tuple(i for i, n in enumerate(item) if n == 1)
            w = quantize(value.astype(np.float32), info.q.dtype, axes)
            self._put(target, info, np.asarray(w.q), "q")
            self._put(target, info, np.asarray(w.scale), "scale")
            self._seen.add(f"{name}_scale")

    def missing(self) -> list[str]:
        """The tensors still to come: each held-quantized weight's values and its scales."""
        quantized = {f"{m}.weight" for m in projection_modules(self.cfg) if kept_module(m, self.cfg)
                     } if self.cfg.weight_quant else set()
        names = [n for name in hf_names(self.cfg) for n in ((name, f"{name}_scale") if name in quantized else (name,))]
        return [n for n in names if n not in self._seen]

    def finish(self, place: Callable[[str, np.ndarray], object] | None = None) -> Params:
        """The parameter tree; `place(path, host_array)` moves each array to its device(s)."""
        for prefix, parts in self._held.items():
            raise CheckpointError(f"checkpoint has {prefix}{{{', '.join(sorted(parts))}}}_conv1d.weight but not its "
                                  f"{', '.join(p for p in 'qkv' if p not in parts)} part")
        missing = self.missing()
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")
        weightless = self.cfg.family in WEIGHTLESS_NORM_FAMILIES  # (OLMo's norms: ones, in no checkpoint)
        for path, info in self._decl.items():  # (sinks no layer of a stack holds: none)
            if path not in self._arrays and weightless and path.endswith("norm"):
                self._arrays[path] = np.ones(info.shape, np.dtype(info.dtype or self.dtype))
            elif path.endswith(tuple(ABSENT_FILL)) and path not in self._arrays:
                self._arrays[path] = _blank(path, info.shape, np.dtype(info.dtype or self.dtype))
        flat = {}
        for path in list(self._arrays):
            host = self._arrays.pop(path)  # drop our reference so host memory is freed as we go
            flat[path] = place(path, host) if place else host
        return from_param_paths(self.cfg, flat)
