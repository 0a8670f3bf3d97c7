"""Quantized weights of HF checkpoints, dequantized as they are read.

Two descriptions of quantized weights are read from a checkpoint's `quantization_config`:

- `quant_method: "fp8"` (transformers' and vLLM's FP8 checkpoints: Qwen3-FP8, DeepSeek-V3, AutoFP8's): float8 e4m3
  weights with a float32 scale per block of `weight_block_size` (`weight_scale_inv`), or one per tensor
  (`weight_scale`) without a block size;
- `quant_method: "compressed-tensors"` (llm-compressor's checkpoints: RedHatAI's FP8-dynamic, W8A8, W4A16 models):
  its config groups' weights, float8 ("float-quantized"), int8 ("int-quantized", "naive-quantized") or integers of
  1 to 8 bits packed into int32 ("pack-quantized"), with a scale per tensor, per output channel, per group of input
  columns or per block, and zero points when asymmetric;
- `quant_method: "gptq"` (AutoGPTQ's and GPTQModel's checkpoints): 2-, 4- or 8-bit integers packed into int32
  along the input (`qweight` [K / pack, N]), a zero point packed along the output (`qzeros`) and a float scale
  (`scales`) per group of `group_size` input rows, the group of each row given by `g_idx` when the rows were
  quantized in activation order (`desc_act`); the "gptq" checkpoint format stores each zero point minus one;
- `quant_method: "awq"` (AutoAWQ's GEMM checkpoints): 4-bit integers packed into int32 along the output
  (`qweight` [K, N / 8], in AWQ's interleaved order), zero points packed alike, a scale per group of input rows;
- `quant_method: "mxfp4"` (gpt-oss's): 4-bit floats with a power-of-two scale per 32 inputs (`jaxserve.mxfp4`);
- `quant_method: "bitsandbytes"` (transformers' 4-bit NF4/FP4 and 8-bit LLM.int8() checkpoints: `jaxserve.bnb`).

Float8 (e4m3) and int8 weights with one scale per tensor or per output channel, symmetric, are kept so in memory
(`keepable`: `models.quantized` holds them exactly, a tensor's scale as every channel's). Every other quantized
weight is dequantized to float32 (`(q - zero_point) * scale`, as compressed-tensors computes it) and served in the
model's dtype. Activations are never quantized (their `input_scale` and the like is dropped).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from jaxserve import bnb, mxfp4
from jaxserve.errors import UnsupportedModelError

# Tensors of a quantized module besides its weight; the activations' are dropped (the matmuls run unquantized).
WEIGHT_PARTS = ("weight", "weight_packed", "weight_scale", "weight_scale_inv", "weight_zero_point", "weight_shape",
                "qweight", "qzeros", "scales", "g_idx")
DROPPED_PARTS = ("input_scale", "input_zero_point", "output_scale", "output_zero_point")
_QUANTIZED_DTYPES = (np.dtype(np.int8), np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))
_FLOAT8_VALUES = {np.dtype(t): np.arange(256, dtype=np.uint8).view(t).astype(np.float32)
                  for t in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2)}
_FORMATS = ("float-quantized", "int-quantized", "naive-quantized", "pack-quantized")
_STRATEGIES = ("tensor", "channel", "group", "block")


@dataclass(frozen=True)
class WeightQuant:
    """How one module's weight is stored."""

    type: str  # "float" or "int"
    num_bits: int
    strategy: str  # "tensor", "channel", "group" or "block"
    symmetric: bool = True
    group_size: int | None = None
    block: tuple[int, int] | None = None  # (rows, columns) of a block
    packed: bool = False  # integers packed into int32 (`weight_packed`, `weight_shape`)
    scale_name: str = "weight_scale"
    # or "gptq", "awq": their `qweight`, `qzeros`, `scales` (and `g_idx`); "mxfp4"; bitsandbytes' "bnb4" (with
    # double quantization: "bnb4-double") and "bnb8"
    layout: str = "compressed-tensors"
    zero_offset: int = 0  # added to each stored zero point (GPTQ's "gptq" format stores it minus one)
    act_order: bool = False  # GPTQ's rows in activation order: each row's group from `g_idx`

    def needs(self) -> tuple[str, ...]:
        """The tensors (parts of the module) its weight is read from."""
        if self.layout == "mxfp4":
            return mxfp4.PARTS
        if self.layout.startswith("bnb"):
            return bnb.PARTS_8BIT if self.layout == "bnb8" else bnb.PARTS_4BIT + (
                bnb.NESTED_PARTS if self.layout == "bnb4-double" else ())
        if self.layout != "compressed-tensors":  # (AutoAWQ's symmetric weights store no zero points)
            zeros = () if self.layout == "awq" and self.symmetric else ("qzeros",)
            return ("qweight", "scales", *zeros) + (("g_idx",) if self.act_order else ())
        parts = ["weight_packed", "weight_shape"] if self.packed else ["weight"]
        parts.append(self.scale_name)
        if not self.symmetric:
            parts.append("weight_zero_point")
        return tuple(parts)


@dataclass(frozen=True)
class Group:
    targets: tuple[str, ...]
    weights: WeightQuant


@dataclass(frozen=True)
class CheckpointQuantization:
    """A checkpoint's quantized weights: each config group's targets and storage, and the modules left alone."""

    groups: tuple[Group, ...]
    ignore: tuple[str, ...] = ()

    def scheme(self, module: str) -> WeightQuant | None:
        """The storage of `module`'s weight (an HF module name), or None for a module kept unquantized."""
        if any(_matches(t, module) for t in self.ignore):
            return None
        for g in self.groups:
            if any(t == "Linear" or _matches(t, module) for t in g.targets):
                return g.weights
        return None


def keepable(q: WeightQuant | None) -> str | None:
    """The in-memory form (`models.quantized.METHODS`) that holds weights stored as `q` exactly, or None: float8 or
    8-bit integer values (compressed-tensors' packed ones too), symmetric, one scale per tensor or per output
    channel; GPTQ's symmetric 8-bit weights with one group (`group_size` -1: a scale per channel)."""
    if q is None or not q.symmetric or q.num_bits != 8 or q.layout == "awq":
        return None
    if q.layout == "gptq":
        return "int8" if not q.group_size or q.group_size < 0 else None
    return ("fp8" if q.type == "float" else "int8") if q.strategy in ("tensor", "channel") else None


_KEPT_DTYPES = {"fp8": np.dtype(ml_dtypes.float8_e4m3fn), "int8": np.dtype(np.int8)}


def kept(q: WeightQuant, parts: Mapping[str, np.ndarray], module: str) -> tuple[np.ndarray, np.ndarray]:
    """A keepable module's values [N, K] (float8, or int8: packed ones unpacked, GPTQ's less its zero point) and
    their scales broadcast to [N, K] (a view: every column of a row holds the row's scale)."""
    if q.layout == "bnb8":
        values, scale = bnb.int8_values(parts, module)
        return values, np.broadcast_to(scale, values.shape)
    if q.layout == "gptq" or q.packed:
        if q.layout == "gptq":  # [K, N] less the zero points [1, N]; scales [1, N]
            values = (_unpack_words(parts["qweight"], 8, 0) - _unpack_words(parts["qzeros"], 8, 1) - q.zero_offset).T
            scale = np.asarray(parts["scales"], np.float32).reshape(-1, 1)
        else:
            shape = tuple(int(s) for s in parts["weight_shape"])
            values = unpack_int32(parts["weight_packed"], 8, shape[-1])
            scale = expand(q, np.asarray(parts[q.scale_name], np.float32), shape, module)
        if values.min(initial=0) < -128 or values.max(initial=0) > 127 or scale.shape[0] not in (1, values.shape[0]):
            raise ValueError(f"{module}: 8-bit values or scales of shape {scale.shape} do not fit a symmetric int8 "
                             f"weight of shape {values.shape}")
        return np.ascontiguousarray(values.astype(np.int8)), np.broadcast_to(scale, values.shape)
    values = parts["weight"]
    want = _KEPT_DTYPES[keepable(q)]
    if values.dtype != want or values.ndim != 2:
        raise ValueError(f"{module}.weight is {values.dtype} {tuple(values.shape)}, not the {want.name} matrix its "
                         "config names")
    scale = expand(q, np.asarray(parts[q.scale_name], np.float32), values.shape, module)
    return values, np.broadcast_to(scale, values.shape)


def _matches(target: str, module: str) -> bool:
    """compressed-tensors' target forms: `re:` and a regular expression, or a name (or a suffix of one)."""
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return module == target or module.endswith("." + target)


def parse_quantization(quant: Mapping[str, Any] | None) -> CheckpointQuantization | None:
    """The quantized weights a `quantization_config` describes (None: none; a KV cache scheme alone quantizes no
    weight); unsupported ones are refused by name."""
    quant = quant or {}
    method = quant.get("quant_method")
    if method == "fp8":
        block = quant.get("weight_block_size")
        if quant.get("fmt", "e4m3") != "e4m3":
            raise UnsupportedModelError(f"fp8 weights in format {quant['fmt']!r} are not supported (only e4m3)")
        weights = (WeightQuant("float", 8, "block", block=(int(block[0]), int(block[1])), scale_name="weight_scale_inv")
                   if block else WeightQuant("float", 8, "tensor"))
        ignore = tuple(quant.get("modules_to_not_convert") or ()) + tuple(quant.get("ignored_layers") or ())
        return CheckpointQuantization((Group(("Linear",), weights),), ignore)
    if method in ("gptq", "awq"):
        return _gptq_or_awq(method, quant)
    if method == "mxfp4":  # (its modules_to_not_convert are globs; only `*_blocks` tensors are quantized anyway)
        return CheckpointQuantization((Group(("Linear",), WeightQuant("float", 4, "group", group_size=32,
                                                                        layout="mxfp4")),))
    if method == "bitsandbytes":
        if quant.get("load_in_8bit") or quant.get("_load_in_8bit"):
            weights = WeightQuant("int", 8, "channel", layout="bnb8")
        elif quant.get("load_in_4bit") or quant.get("_load_in_4bit"):
            double = bool(quant.get("bnb_4bit_use_double_quant"))
            weights = WeightQuant("float", 4, "block", layout="bnb4-double" if double else "bnb4")
        else:
            raise UnsupportedModelError("a bitsandbytes quantization_config that loads neither 4- nor 8-bit weights")
        return CheckpointQuantization((Group(("Linear",), weights),), tuple(quant.get("llm_int8_skip_modules") or ()))
    if method not in (None, "compressed-tensors"):
        raise UnsupportedModelError(
            f"quantized weights (quantization_config quant_method {method!r}) are not supported; supported: fp8, "
            "compressed-tensors (float8, int8 and packed integer weights), gptq, awq, mxfp4, bitsandbytes")
    if not quant.get("config_groups"):
        return None
    for key in ("sparsity_config", "transform_config"):
        if quant.get(key):
            raise UnsupportedModelError(f"compressed-tensors checkpoints with a {key} are not supported")
    groups = []
    for name, g in quant["config_groups"].items():
        fmt = g.get("format") or quant.get("format")
        w = g.get("weights")
        if not w:
            raise UnsupportedModelError(f"compressed-tensors config group {name!r} quantizes no weights (only weight "
                                        "quantization is supported)")
        if fmt not in _FORMATS:
            raise UnsupportedModelError(f"compressed-tensors format {fmt!r} (config group {name!r}) is not supported; "
                                        f"supported: {', '.join(_FORMATS)}")
        kind, bits, strategy = w.get("type", "int"), int(w.get("num_bits", 8)), w.get("strategy", "tensor")
        if strategy not in _STRATEGIES or w.get("dynamic") or (kind, bits) not in (
                [("float", 8)] + [("int", b) for b in range(1, 9)]):
            raise UnsupportedModelError(
                f"compressed-tensors weights {kind}{bits}, strategy {strategy!r}{' (dynamic)' if w.get('dynamic') else ''} "
                f"(config group {name!r}) are not supported: float8 or 1- to 8-bit integers, per tensor, channel, "
                "group or block")
        packed = fmt == "pack-quantized"
        if (fmt, kind) in (("float-quantized", "int"), ("int-quantized", "float")) or (not packed and bits != 8):
            raise UnsupportedModelError(f"compressed-tensors format {fmt!r} does not hold {kind}{bits} weights "
                                        f"(config group {name!r})")
        if w.get("actorder") == "group":
            raise UnsupportedModelError(f"compressed-tensors weights in activation order (actorder 'group', config "
                                        f"group {name!r}) are not supported")
        block = w.get("block_structure")
        if (strategy == "group") != bool(w.get("group_size")) or (strategy == "block") != bool(block):
            raise UnsupportedModelError(f"compressed-tensors config group {name!r}: strategy {strategy!r} with "
                                        f"group_size {w.get('group_size')} and block_structure {block}")
        groups.append(Group(tuple(g.get("targets") or ("Linear",)), WeightQuant(
            kind, bits, strategy, bool(w.get("symmetric", True)), w.get("group_size"),
            (int(block[0]), int(block[1])) if block else None, packed)))
    return CheckpointQuantization(tuple(groups), tuple(quant.get("ignore") or ()))


def _gptq_or_awq(method: str, quant: Mapping[str, Any]) -> CheckpointQuantization:
    """A GPTQ or AWQ `quantization_config`: one scheme for every linear layer but those left out."""
    bits, group = int(quant.get("bits", 4)), int(quant.get("group_size", 128))
    if method == "awq":
        version = str(quant.get("version", "gemm")).lower()
        if version != "gemm" or bits != 4:
            raise UnsupportedModelError(f"awq checkpoints of version {version!r} with {bits}-bit weights are not "
                                        "supported (only AutoAWQ's GEMM layout, 4-bit)")
        weights = WeightQuant("int", 4, "group", not quant.get("zero_point", True), group, layout="awq")
    else:
        fmt = quant.get("checkpoint_format") or quant.get("format") or "gptq"
        if fmt not in ("gptq", "gptq_v2") or bits not in (2, 4, 8) or quant.get("dynamic"):
            raise UnsupportedModelError(
                f"gptq checkpoints with {bits}-bit weights in format {fmt!r}{' and dynamic per-module settings' if quant.get('dynamic') else ''} "
                "are not supported (2-, 4- or 8-bit weights, format gptq or gptq_v2)")
        weights = WeightQuant("int", bits, "group", bool(quant.get("sym", True)), group, layout="gptq",
                              zero_offset=1 if fmt == "gptq" else 0, act_order=bool(quant.get("desc_act")))
    ignore = tuple(quant.get("modules_to_not_convert") or ())
    return CheckpointQuantization((Group(("Linear",), weights),), ignore)


def _unpack_words(packed: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Unsigned `bits`-bit integers packed into int32 words along `axis`, value i of a word at bits i * bits:
    the axis grows `32 // bits` times."""
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    words = np.expand_dims(packed.astype("<i4").view(np.uint32), axis + 1)
    shape = [1] * words.ndim
    shape[axis + 1] = len(shifts)
    values = (words >> shifts.reshape(shape)) & np.uint32((1 << bits) - 1)
    out_shape = list(packed.shape)
    out_shape[axis] *= len(shifts)
    return values.reshape(out_shape).astype(np.int32)


_AWQ_COLUMNS = np.array([0, 4, 1, 5, 2, 6, 3, 7])  # column c of a word holds its value number _AWQ_COLUMNS[c]


def _dequantize_gptq_or_awq(q: WeightQuant, parts: Mapping[str, np.ndarray], module: str) -> np.ndarray:
    """A GPTQ or AWQ module's float32 weight [N, K]: `(q - zero) * scale` of each row's group."""
    scales = np.asarray(parts["scales"], np.float32)  # [groups, N]
    if q.layout == "awq":
        values = _unpack_words(parts["qweight"], 4, 1)  # [K, N], each word's columns in AWQ's order
        values = values.reshape(values.shape[0], -1, 8)[:, :, _AWQ_COLUMNS].reshape(values.shape)
        if q.symmetric:
            zeros = np.full(scales.shape, 8, np.int32)
        else:
            zeros = _unpack_words(parts["qzeros"], 4, 1)
            zeros = zeros.reshape(zeros.shape[0], -1, 8)[:, :, _AWQ_COLUMNS].reshape(zeros.shape)
    else:
        values = _unpack_words(parts["qweight"], q.num_bits, 0)  # [K, N]
        zeros = _unpack_words(parts["qzeros"], q.num_bits, 1) + q.zero_offset  # [groups, N]
    K, N = values.shape
    if scales.shape[1] != N or zeros.shape != scales.shape:
        raise ValueError(f"{module}: scales {scales.shape} and zero points {zeros.shape} do not fit a weight of "
                         f"{K} x {N}")
    group = q.group_size if q.group_size and q.group_size > 0 else K
    rows = (np.asarray(parts["g_idx"], np.int64) if q.act_order else np.arange(K) // group)
    if rows.shape != (K,) or rows.max(initial=0) >= scales.shape[0]:
        raise ValueError(f"{module}: the groups of its {K} input rows ({rows.shape}) do not fit {scales.shape[0]} "
                         "scales")
    return ((values - zeros[rows]) * scales[rows]).T.copy()


def dequantize(q: WeightQuant, parts: Mapping[str, np.ndarray], module: str) -> np.ndarray:
    """A module's float32 weight [N, K] from its stored parts."""
    if q.layout.startswith("bnb"):
        if q.layout == "bnb8":
            values, scale = bnb.int8_values(parts, module)
            return values * scale
        return bnb.dequantize_4bit(parts, module)
    if q.layout != "compressed-tensors":
        return _dequantize_gptq_or_awq(q, parts, module)
    if q.packed:
        shape = tuple(int(s) for s in parts["weight_shape"])
        values = unpack_int32(parts["weight_packed"], q.num_bits, shape[-1])
    else:
        values = parts["weight"]
        shape = values.shape
        if q.type == "int" and values.dtype != np.int8 or q.type == "float" and values.dtype.itemsize != 1:
            raise ValueError(f"{module}.weight is {values.dtype}, not the {q.type}{q.num_bits} its config names")
    if len(shape) != 2:
        raise ValueError(f"{module}: quantized weights of shape {shape} are not supported (only matrices)")
    # A float8 byte's value looked up: 3x faster than ml_dtypes' conversion.
    w = _FLOAT8_VALUES[values.dtype][values.view(np.uint8)] if values.dtype in _FLOAT8_VALUES else values.astype(
        np.float32)
    scale = expand(q, np.asarray(parts[q.scale_name], np.float32), shape, module)
    if not q.symmetric:
        zp = parts["weight_zero_point"]
        if q.packed and q.strategy in ("channel", "group"):  # packed along the rows
            zp = unpack_int32(np.ascontiguousarray(zp.T), q.num_bits, shape[0]).T
        w -= expand(q, zp.astype(np.float32), shape, module)
    return w * scale


def expand(q: WeightQuant, s: np.ndarray, shape: tuple[int, ...], module: str) -> np.ndarray:
    """A scale (or zero point) broadcast to the weight's [N, K]."""
    N, K = shape
    if q.strategy == "tensor":
        if s.size != 1:
            raise ValueError(f"{module}: a per-tensor scale has shape {s.shape}")
        return s.reshape(1, 1)
    if q.strategy == "channel":
        if s.size != N:
            raise ValueError(f"{module}: a per-channel scale has shape {s.shape}, the weight {shape}")
        return s.reshape(N, 1)
    if q.strategy == "group":
        g = int(q.group_size)
        if s.shape != (N, -(-K // g)):
            raise ValueError(f"{module}: a scale per group of {g} has shape {s.shape}, the weight {shape}")
        return np.repeat(s, g, axis=1)[:, :K]
    bn, bk = q.block
    if s.shape != (-(-N // bn), -(-K // bk)):
        raise ValueError(f"{module}: a scale per {bn} x {bk} block has shape {s.shape}, the weight {shape}")
    return np.repeat(np.repeat(s, bn, axis=0), bk, axis=1)[:N, :K]


def unpack_int32(packed: np.ndarray, bits: int, cols: int) -> np.ndarray:
    """Signed integers of `bits` bits packed densely into each row's int32 words (compressed-tensors' packing: the
    i-th value at bits i*bits.. of the row's little-endian bit stream, offset by 2^(bits-1)): [rows, cols] int32."""
    raw = np.ascontiguousarray(packed.astype("<i4")).view(np.uint8)  # [rows, 4 * words]
    if bits == 8:
        values = raw[:, :cols].astype(np.int32)
    elif bits == 4:
        values = np.stack([raw & 0xF, raw >> 4], axis=-1).reshape(raw.shape[0], -1)[:, :cols].astype(np.int32)
    else:
        stream = np.unpackbits(raw, axis=-1, bitorder="little")[:, :cols * bits]
        values = (stream.reshape(raw.shape[0], cols, bits).astype(np.int32) << np.arange(bits, dtype=np.int32)).sum(-1)
    return values - (1 << (bits - 1))


def dequantized_tensors(tensors: Iterable[tuple[str, np.ndarray]], quant: CheckpointQuantization,
                        keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """A checkpoint's (name, array) stream with each quantized module's parts replaced by its float32 `weight`
    (as soon as all have been read, in whatever order and file), the activations' scales dropped and every other
    tensor as float32. A keepable module that `keep` accepts comes as its stored `weight` and a float32
    `weight_scale` of the weight's shape (`kept`) instead. Raises ValueError naming a module whose parts never
    all came."""
    pending: dict[str, tuple[WeightQuant, dict[str, np.ndarray]]] = {}
    layouts = {g.weights.layout for g in quant.groups}
    is_bnb = any(layout.startswith("bnb") for layout in layouts)
    for name, array in tensors:
        module, _, part = name.rpartition(".")
        if part in DROPPED_PARTS:
            continue
        packed = mxfp4.mxfp4_part(name) if "mxfp4" in layouts else bnb.bnb_part(name) if is_bnb else None
        if packed is not None:  # `{module}_blocks`, `{module}_scales`: the tensor `{module}` itself; bitsandbytes'
            module, part = packed  # `{module}.weight.absmax`, `{module}.SCB`, ...: parts of `{module}.weight`
            if part == "weight_format":
                continue
        q = quant.scheme(module) if part in WEIGHT_PARTS or packed else None
        stored = array.dtype in _QUANTIZED_DTYPES or is_bnb and array.dtype == np.uint8  # (4-bit codes)
        if q is None or part == "weight" and not stored:  # norms, embeddings, ignored
            if part in WEIGHT_PARTS[1:]:
                raise ValueError(f"tensor {name!r}: {module} is not quantized in the checkpoint's quantization_config")
            yield name, array.astype(np.float32, copy=False)
            continue
        if part not in q.needs():  # GPTQ's `g_idx` of rows in order: each row's group is its index over the size
            continue
        parts = pending.setdefault(module, (q, {}))[1]
        parts[part] = array
        if all(p in parts for p in q.needs()):
            del pending[module]
            if q.layout == "mxfp4":
                yield module, mxfp4.dequantize_mxfp4(parts["blocks"], parts["scales"], module)
            elif keep is not None and keepable(q) and keep(module):
                values, scale = kept(q, parts, module)
                yield f"{module}.weight", values
                yield f"{module}.weight_scale", scale
            else:
                yield f"{module}.weight", dequantize(q, parts, module)
    for module, (q, parts) in pending.items():
        sep = "_" if q.layout == "mxfp4" else "."  # (an MXFP4 tensor's parts: `{name}_blocks`, `{name}_scales`)
        missing = [f"{module}{sep}{p}" for p in q.needs() if p not in parts]
        raise ValueError(f"quantized weight {module} is missing {', '.join(missing)}")
