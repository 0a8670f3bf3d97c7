"""LLaVA-NeXT's and LLaVA-OneVision's "anyres" images: the whole image in one crop, then crops of it at the
resolution (of the config's pinpoints) that fits it best; their features laid out as the image, the padding's
features dropped (unpadded), each row ended by a learned newline embedding. LLaVA-OneVision (`anyres_max_N`) then
shrinks the kept grid (bilinear, as torch's `interpolate`) when it holds more than about N crops' features.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def anyres_layout(cfg: Any, size: tuple[int, int]) -> tuple[int, int, int, int]:
    """Where an image's crop features are kept: its crops' grid (rows, columns) at the best pinpoint, and the rows
    and columns of the grid's features kept after unpadding (the features of the padding around the image dropped),
    as transformers' model computes them."""
    from jaxserve.images import best_resolution

    h, w = size
    best_h, best_w = best_resolution((h, w), cfg.grid_pinpoints)
    rows, cols = best_h // cfg.image_size, best_w // cfg.image_size
    side = cfg.image_size // cfg.patch_size
    fh, fw = rows * side, cols * side  # the grid's features
    if w / h > fw / fh:
        new_h = int(round(h * (fw / w), 7))
        pad = (fh - new_h) // 2
        return rows, cols, fh - 2 * pad, fw
    new_w = int(round(w * (fh / h), 7))
    pad = (fw - new_w) // 2
    return rows, cols, fh, fw - 2 * pad


def shrunk(cfg: Any, kept: tuple[int, int]) -> tuple[int, int]:
    """LLaVA-OneVision: the kept grid's (rows, columns) after shrinking it to about `max_crops` crops' features
    (only when it is over 1.1 times that, in side); the grid as it is otherwise (and for LLaVA-NeXT)."""
    kh, kw = kept
    if cfg.max_crops is None:
        return kh, kw
    side = cfg.image_size // cfg.patch_size
    ratio = math.sqrt(kh * kw / (cfg.max_crops * side**2))
    return (int(kh // ratio), int(kw // ratio)) if ratio > 1.1 else (kh, kw)


def anyres_tokens(cfg: Any, size: tuple[int, int]) -> int:
    """Tokens of an anyres image of (height, width) `size`: the whole image's, then the kept (and shrunk) grid
    features with a newline ending each of their rows."""
    _, _, kh, kw = anyres_layout(cfg, size)
    h, w = shrunk(cfg, (kh, kw))
    return cfg.tokens_per_image + h * (w + 1)


def bilinear(x: np.ndarray, height: int, width: int) -> np.ndarray:
    """x [H, W, E] resized to [height, width, E] as torch's `interpolate(mode="bilinear")` resizes (half-pixel
    centres, no corner alignment, no antialiasing), in float32."""
    def taps(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        scale = np.float32(n_in) / np.float32(n_out)
        src = np.maximum((np.arange(n_out, dtype=np.float32) + np.float32(0.5)) * scale - np.float32(0.5), 0)
        lo = src.astype(np.int64)
        return lo, np.minimum(lo + 1, n_in - 1), (src - lo).astype(np.float32)

    xf = x.astype(np.float32)
    r0, r1, fr = taps(x.shape[0], height)
    c0, c1, fc = taps(x.shape[1], width)
    rows = xf[r0] * (1 - fr)[:, None, None] + xf[r1] * fr[:, None, None]
    return rows[:, c0] * (1 - fc)[None, :, None] + rows[:, c1] * fc[None, :, None]


def pack_anyres(cfg: Any, feats: np.ndarray, newline: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """An anyres image's embeddings from its crops' projected features [1 + rows * cols, side * side, E] (the whole
    image's first): those, then the grid's features in image order, unpadded (and shrunk), each row ended by
    `newline`."""
    rows, cols, kh, kw = anyres_layout(cfg, size)
    side = cfg.image_size // cfg.patch_size
    E = feats.shape[-1]
    grid = feats[1:].reshape(rows, cols, side, side, E).transpose(0, 2, 1, 3, 4).reshape(rows * side, cols * side, E)
    top, left = (rows * side - kh) // 2, (cols * side - kw) // 2
    kept = grid[top:top + kh, left:left + kw]
    h, w = shrunk(cfg, (kh, kw))
    if (h, w) != (kh, kw):
        kept = bilinear(kept, h, w).astype(feats.dtype)
    lines = np.concatenate([kept, np.broadcast_to(newline.astype(kept.dtype), (h, 1, E))], axis=1)
    return np.concatenate([feats[0], lines.reshape(-1, E)])
