"""bitsandbytes checkpoints (`quant_method: "bitsandbytes"`, as transformers saves them: the many `*-bnb-4bit` and
`*-8bit` uploads), read as the weights they stand for.

4-bit (`load_in_4bit`, NF4 or FP4): a linear layer's `weight` holds two 4-bit codes a byte, the first in the high
nibble, of the weight's elements in row-major order; `weight.quant_map` the 16 values a code stands for; each
block of `blocksize` elements one scale, `weight.absmax`. With double quantization those scales are themselves
8-bit codes (`weight.nested_quant_map`) times a scale per `nested_blocksize` of them (`weight.nested_absmax`),
plus `nested_offset`. `weight.quant_state.bitsandbytes__{nf4,fp4}` is a JSON record (bytes) of the block sizes,
the offset and the weight's shape. Dequantized to float32.

8-bit (`load_in_8bit`, LLM.int8()): `weight` int8 [N, K] and `SCB` [N], the weight being `weight * SCB / 127`: a
symmetric int8 weight with a scale per output channel, held in memory as stored where `--quantization int8` asks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

import numpy as np

# A 4-bit weight's parts after `{module}.`: its codes, and its quantization state.
PARTS_4BIT = ("weight", "weight.absmax", "weight.quant_map", "weight.quant_state")
NESTED_PARTS = ("weight.nested_absmax", "weight.nested_quant_map")
PARTS_8BIT = ("weight", "SCB")
_PART = re.compile(r"^(.+?)\.(weight\.(?:absmax|quant_map|nested_absmax|nested_quant_map)|weight\.quant_state"
                   r"(?=\.bitsandbytes__\w+$)|SCB|weight_format)(?:\.bitsandbytes__\w+)?$")


def bnb_part(name: str) -> tuple[str, str] | None:
    """(module, part) of a bitsandbytes tensor's name other than the weight's own (`...weight.absmax`, `...SCB`,
    the quant state, ...), else None."""
    m = _PART.match(name)
    return None if m is None else (m.group(1), m.group(2))


def dequantize_4bit(parts: Mapping[str, np.ndarray], module: str) -> np.ndarray:
    """A 4-bit module's float32 weight [N, K]."""
    state = json.loads(bytes(np.asarray(parts["weight.quant_state"], np.uint8)).decode())
    shape, block = tuple(state["shape"]), int(state["blocksize"])
    codes = np.asarray(parts["weight"], np.uint8).reshape(-1)
    count = int(np.prod(shape))
    if codes.size * 2 < count or len(shape) != 2:
        raise ValueError(f"{module}: {codes.size} bytes of 4-bit codes cannot hold a weight of shape {shape}")
    absmax = np.asarray(parts["weight.absmax"])
    if "nested_blocksize" in state:  # double quantization: the scales are 8-bit codes themselves
        nested = np.asarray(parts["weight.nested_absmax"], np.float32)
        absmax = np.asarray(parts["weight.nested_quant_map"], np.float32)[absmax.astype(np.int64)] * np.repeat(
            nested, int(state["nested_blocksize"]))[:absmax.size] + np.float32(state["nested_offset"])
    absmax = np.asarray(absmax, np.float32)
    if absmax.size * block < count:
        raise ValueError(f"{module}: {absmax.size} scales of {block} elements cannot cover a weight of shape {shape}")
    values = np.asarray(parts["weight.quant_map"], np.float32)[np.stack([codes >> 4, codes & 15], -1).reshape(-1)]
    return (values[:count] * np.repeat(absmax, block)[:count]).reshape(shape)


def int8_values(parts: Mapping[str, np.ndarray], module: str) -> tuple[np.ndarray, np.ndarray]:
    """An 8-bit module's int8 weight [N, K] and its scale per output channel [N, 1] (SCB / 127)."""
    values, scb = np.asarray(parts["weight"]), np.asarray(parts["SCB"], np.float32).reshape(-1)
    if values.dtype != np.int8 or values.ndim != 2 or scb.shape != (values.shape[0],):
        raise ValueError(f"{module}: an 8-bit weight {values.dtype} {values.shape} needs one SCB per row, got "
                         f"{scb.shape}")
    return values, (scb / 127.0).reshape(-1, 1)
