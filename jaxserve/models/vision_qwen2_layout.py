"""How Qwen2-VL's images lie in a bucket of patches for its vision tower (`models.vision_qwen2`): the bucket's size,
and each patch's row and column and its segments (frame, window), in the processor's order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

BUCKET_UNIT = 64  # patches: a bucket is this times a power of two


def qwen_bucket(num_patches: int) -> int:
    """The padded patch count a call compiles for: 64 patches times the least power of two that holds them."""
    units = -(-max(num_patches, 1) // BUCKET_UNIT)
    return BUCKET_UNIT * (1 << (units - 1).bit_length())


def qwen_layout(cfg: Any, grids: Sequence[tuple[int, int, int]]) -> tuple[np.ndarray, ...]:
    """Each patch's (row, column) [N, 2], frame id [N] and window id [N] (ids unique across all the images), for
    patches in the processor's order: frame by frame, merge groups row by row, each group's patches row by row."""
    m, W = cfg.spatial_merge_size, cfg.window_merged
    pos, frames, windows = [], [], []
    next_frame = next_window = 0
    for t, h, w in grids:
        if h % m or w % m or t < 1:
            raise ValueError(f"a patch grid {(t, h, w)} must have rows and columns divisible by the merge size {m}")
        rc = np.stack(np.meshgrid(np.arange(h), np.arange(w), indexing="ij"), -1)  # [h, w, 2]
        rc = rc.reshape(h // m, m, w // m, m, 2).transpose(0, 2, 1, 3, 4).reshape(h * w, 2)
        r, c = rc[:, 0], rc[:, 1]
        pos.append(np.tile(rc, (t, 1)))
        frames.append(next_frame + np.repeat(np.arange(t), h * w))
        if W:  # Qwen2.5-VL: windows of W x W merged patches, the last row and column of them cut short
            across = -(-(w // m) // W)
            per_frame = -(-(h // m) // W) * across
            window = (r // m // W) * across + (c // m // W)
            windows.append(next_window + (np.arange(t) * per_frame)[:, None] + window[None, :])
            next_window += t * per_frame
        next_frame += t
    frames = np.concatenate(frames).astype(np.int32)
    windows = np.concatenate([a.reshape(-1) for a in windows]).astype(np.int32) if windows else frames
    return np.concatenate(pos).astype(np.int32), frames, windows


def qwen_token_grid(grid: tuple[int, int, int], cfg: Any) -> tuple[int, int, int]:
    """An image's (t, h, w) patch grid as the language model sees it: (t, h / merge, w / merge) tokens."""
    t, h, w = grid
    return t, h // cfg.spatial_merge_size, w // cfg.spatial_merge_size


def qwen_tokens(grid: tuple[int, int, int], cfg: Any) -> int:
    """How many `<|image_pad|>` tokens (and embeddings) an image of this patch grid has."""
    t, h, w = qwen_token_grid(grid, cfg)
    return t * h * w
