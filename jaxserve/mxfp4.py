"""MXFP4 weights (gpt-oss's checkpoints, `quant_method: "mxfp4"`), dequantized as they are read.

A packed tensor `{name}_blocks` [..., N, K / 32, 16] holds two 4-bit floats (E2M1: sign, 2 exponent bits, 1
mantissa bit) per byte, the low nibble first, for each row's blocks of 32 input columns; `{name}_scales`
[..., N, K / 32] one power-of-two scale per block, an E8M0 byte (2^(s - 127)). The weight is stored out-major
([..., N, K]); the tensor it stands for, `{name}`, is input-major ([..., K, N], as gpt-oss's experts are).
"""

from __future__ import annotations

import numpy as np

# The 16 values of an E2M1 nibble.
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)
PARTS = ("blocks", "scales")


def mxfp4_part(name: str) -> tuple[str, str] | None:
    """(the tensor a packed part stands for, "blocks" or "scales") for `{name}_blocks` / `{name}_scales`, else
    None."""
    for part in PARTS:
        if name.endswith(f"_{part}"):
            return name[: -len(part) - 1], part
    return None


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray, name: str) -> np.ndarray:
    """The float32 tensor [..., K, N] of MXFP4 `blocks` [..., N, K / 32, 16] and `scales` [..., N, K / 32]
    (uint8 both), one leading index at a time (a float32 copy of a gpt-oss layer's experts is 2 GB)."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.ndim < 3 or blocks.shape[-1] != 16 \
            or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"{name}: MXFP4 blocks {blocks.dtype} {tuple(blocks.shape)} and scales {scales.dtype} "
                         f"{tuple(scales.shape)} must be uint8 [..., N, K / 32, 16] and [..., N, K / 32]")
    *lead, n, groups, _ = blocks.shape
    flat_blocks, flat_scales = blocks.reshape(-1, n, groups, 16), scales.reshape(-1, n, groups)
    out = np.empty((flat_blocks.shape[0], groups * 32, n), np.float32)
    for i in range(flat_blocks.shape[0]):
        b = flat_blocks[i]
        values = np.stack([FP4_VALUES[b & 0x0F], FP4_VALUES[b >> 4]], axis=-1).reshape(n, groups, 32)
        values = np.ldexp(values, flat_scales[i].astype(np.int32)[..., None] - 127)
        out[i] = values.reshape(n, groups * 32).T
    return out.reshape(*lead, groups * 32, n)
