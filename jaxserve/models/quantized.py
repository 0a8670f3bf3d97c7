"""Weights kept quantized in memory (`--quantization fp8 | int8 | experts_int8` on an unquantized checkpoint).

A quantized projection is stored as `QuantizedWeight(q, scale)`: `q` in float8_e4m3fn or int8, `scale` one
float32 per output channel (the weight's shape with its input axes kept as size 1), w = q * scale. Scales are
each channel's largest magnitude over the type's largest value (448 for float8_e4m3fn, 127 for int8), so the
largest weight of every channel is stored exactly; int8 rounds to the nearest step. Embeddings, the LM head,
norms, biases and the MoE router stay in the model's dtype (as vLLM's fp8 leaves them).

Each matmul reads the stored values converted to the activations' dtype and multiplies its product by the
scales (`project`, `grouped`): the conversion is fused into the matmul's operand load on a GPU, so a weight is
read at one byte; the products are the float model's on the dequantized weights (`dequantize`), to rounding.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.errors import UnsupportedModelError
from pallas_kernels.grouped_matmul import kernel_fits


@jax.tree_util.register_dataclass
@dataclass
class QuantizedWeight:
    """A weight stored as q * scale: q [..., in, out] quantized, scale float32 with the input axes of size 1."""

    q: Any
    scale: Any

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)


# The input (contracted) logical axes of each quantizable layer weight; the rest are output axes.
INPUT_AXES: dict[str, tuple[str, ...]] = {
    "wq": ("embed", "latent"), "wk": ("embed",), "wv": ("embed",), "wo": ("q_heads", "head_dim"),
    "wq_a": ("embed",), "wkv_a": ("embed",),  # (MLA's query bottleneck and latent: `config_mla`)
    "w_gate": ("embed",), "w_up": ("embed",), "w_down": ("mlp",),
    "we_gate": ("embed",), "we_up": ("embed",), "we_down": ("expert_mlp",),
    "ws_gate": ("embed",), "ws_up": ("embed",), "ws_down": ("mlp",),
}
_EXPERTS = ("we_gate", "we_up", "we_down")


@dataclass(frozen=True)
class Method:
    """An online quantization method: the stored dtype and the layer weights it applies to."""

    dtype: Any
    fields: tuple[str, ...]
    moe_only: bool = False


METHODS: dict[str, Method] = {
    "fp8": Method(jnp.float8_e4m3fn, tuple(INPUT_AXES)),  # every projection (vLLM's online fp8)
    "int8": Method(jnp.int8, tuple(INPUT_AXES)),
    "experts_int8": Method(jnp.int8, _EXPERTS, moe_only=True),  # vLLM's: the MoE experts only
}


def quantized_info(name: str, info: Any, method: str) -> Any:
    """The declaration (`params.ParamInfo`) of layer weight `name` as stored by `method`: a `QuantizedWeight`
    of two infos, or `info` itself for a weight the method leaves alone."""
    m = METHODS[method]
    if name not in m.fields or info is None:
        return info
    inputs = INPUT_AXES[name]
    scale_shape = tuple(1 if a in inputs else n for a, n in zip(info.axes, info.shape, strict=True))
    scale_axes = tuple(None if a in inputs else a for a in info.axes)
    return QuantizedWeight(
        q=dataclasses.replace(info, dtype=jnp.dtype(m.dtype)),
        scale=dataclasses.replace(info, shape=scale_shape, axes=scale_axes, init="ones", dtype=jnp.dtype(jnp.float32)),
    )


def quantize(w: jax.Array, dtype: Any, reduce_axes: tuple[int, ...]) -> QuantizedWeight:
    """`w` stored in `dtype` with one scale per slice over `reduce_axes` (the input axes)."""
    dtype = jnp.dtype(dtype)
    w = w.astype(jnp.float32)
    top = float(jnp.finfo(dtype).max if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).max)
    amax = jnp.max(jnp.abs(w), axis=reduce_axes, keepdims=True)
    scale = jnp.where(amax > 0, amax / top, 1.0)
    x = w / scale
    if jnp.issubdtype(dtype, jnp.integer):
        x = jnp.round(x)
    return QuantizedWeight(jnp.clip(x, -top, top).astype(dtype), scale)


def project(x: jax.Array, w: Any, matmul: Callable[[jax.Array, jax.Array], jax.Array] = jnp.matmul) -> jax.Array:
    """`matmul(x, w)` for a float weight; for a `QuantizedWeight`, `matmul` of x and the stored values converted
    to x's dtype, then times the per-output-channel scales (the product's trailing axes are the weight's output
    axes). The conversion is all the matmul sees of the scales, so XLA:GPU fuses it into the matmul's operand
    load and reads each weight at its stored byte; a scale multiplied into the weight first would be written
    out as a whole bfloat16 copy of the weight (`tests/gpu_compile`)."""
    if not isinstance(w, QuantizedWeight):
        return matmul(x, w)
    y = matmul(x, w.q.astype(x.dtype))
    scale = w.scale
    k = next(k for k in range(1, y.ndim + 1) if math.prod(y.shape[-k:]) == scale.size)
    return (y.astype(jnp.float32) * scale.reshape(y.shape[-k:])).astype(y.dtype)


def grouped(x: jax.Array, w: Any, group_sizes: jax.Array, row_group: jax.Array, matmul: Any = None) -> jax.Array:
    """`jax.lax.ragged_dot(x, w, group_sizes)` (w [G, K, N]) for a float or quantized weight; `row_group` [R] is
    the group of each row of x (rows past the groups any group: they are dropped by the caller). `matmul`: the
    grouped matmul kernel (`pallas_kernels.grouped_matmul`, as `moe_mlp` picks it), used where it takes the shapes.

    On the CPU, with no more rows than groups (a MoE layer's decode at small batch: rows are a token's k
    experts), each row is multiplied by its own group's matrix, gathered: XLA:CPU's ragged dot reads every
    group's matrix whatever the rows. Measured, 8 experts of 1024 x 704 in float32: 2 rows 4.0 -> 0.47 ms, 8 rows
    4.7 -> 3.3 ms (32 rows: 7.2 ms ragged, 43 ms gathered)."""
    quantized = isinstance(w, QuantizedWeight)
    raw = w.q if quantized else w
    groups, k, n = raw.shape
    at = jnp.minimum(row_group, groups - 1)
    if matmul is not None and kernel_fits(k, n):
        y = matmul(x, raw, group_sizes)  # (the kernel converts a quantized weight tile by tile)
    else:
        gather = x.shape[0] <= groups and jax.default_backend() == "cpu"
        m = (raw[at] if gather else raw).astype(x.dtype)
        y = jnp.einsum("rk,rkn->rn", x, m) if gather else jax.lax.ragged_dot(x, m, group_sizes)
    if not quantized:
        return y
    scale = w.scale[:, 0, :][at]  # [R, N]
    return (y.astype(jnp.float32) * scale).astype(y.dtype)


def dequantize(tree: Any, dtype: Any) -> Any:
    """`tree` with every `QuantizedWeight` replaced by q * scale in `dtype` (other leaves as they are): the float
    weights a quantized model computes with."""
    def one(w: Any) -> Any:
        if not isinstance(w, QuantizedWeight):
            return w
        return (w.q.astype(jnp.float32) * w.scale).astype(dtype)

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, QuantizedWeight))


def check_method(method: str, num_experts: int) -> None:
    """Refuse a method that is not one of `METHODS`, or `experts_int8` on a dense model, by name."""
    if method not in METHODS:
        raise UnsupportedModelError(f"unknown weight quantization {method!r}: jaxserve quantizes at load with "
                                    f"{', '.join(METHODS)}")
    if METHODS[method].moe_only and not num_experts:
        raise UnsupportedModelError(f"quantization {method!r} quantizes a mixture-of-experts model's experts; this "
                                    "model has none (fp8 or int8 quantize every projection)")


def quantize_layers(layers: Any, declared: Any, shardings: Any = None, release: bool = False) -> Any:
    """Stacked float `layers` (a `LayerParams`) stored as `declared` (its quantized declaration) says, each
    weight quantized where it lies (into `shardings`, a `LayerParams` of `QuantizedWeight` shardings, if
    given). With `release`, each float weight is deleted once its quantized form is made (the caller must
    not read `layers` again), so the float model and its quantized copy are never both held whole."""
    out = {}
    for f in dataclasses.fields(layers):
        w, info = getattr(layers, f.name), getattr(declared, f.name)
        if not isinstance(info, QuantizedWeight) or w is None:
            continue
        reduce_axes = tuple(i for i, a in enumerate(info.q.axes) if a in INPUT_AXES[f.name])
        target = getattr(shardings, f.name) if shardings is not None else None
        out[f.name] = jax.jit(quantize, static_argnums=(1, 2), out_shardings=target)(w, info.q.dtype, reduce_axes)
        if release and isinstance(w, jax.Array):
            jax.block_until_ready(out[f.name])
            w.delete()
    return dataclasses.replace(layers, **out)
