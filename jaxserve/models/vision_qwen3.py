"""What Qwen3-VL's vision tower adds to Qwen2-VL's (`models.vision_qwen2`): a bias on the patch embedding, a learned
square grid of position embeddings resampled (bilinear, corners aligned) to each image's patch grid and added to
the patches before the first block, and deepstack: the outputs of a few blocks (`deepstack_visual_indexes`), each
merged by its own merger (normed after the merge groups are concatenated), which the language model adds to the
hidden states of the image's tokens after its first layers (`models.llama.forward`). An image token's embeddings
are the merger's and then each deepstack merger's, side by side (`QwenVisionConfig.embed_width`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.errors import UnsupportedModelError


def qwen3_fields(v: dict[str, Any], depth: int) -> dict[str, Any]:
    """The Qwen3-VL fields of a vision config (transformers' defaults filled in), checked."""
    n = int(v["num_position_embeddings"])
    if n < 1 or math.isqrt(n) ** 2 != n:
        raise UnsupportedModelError(f"vision num_position_embeddings {n} is not a square grid")
    indexes = tuple(int(i) for i in v.get("deepstack_visual_indexes") or ())
    if len(set(indexes)) != len(indexes) or any(not 0 <= i < depth for i in indexes):
        raise UnsupportedModelError(f"vision deepstack_visual_indexes {list(indexes)} must be distinct blocks of the "
                                    f"{depth}")
    return dict(num_position_embeddings=n, deepstack_visual_indexes=indexes)


def merger_tensors(norm_width: int, wide: int, out: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """A Qwen3-VL merger's tensors (HF name under the merger -> (our key, HF shape)): a LayerNorm over the patch's
    width (the merger) or over a merge group's (a deepstack merger's), then Linear-GELU-Linear."""
    return {"norm.weight": ("norm", (norm_width,)), "norm.bias": ("norm_b", (norm_width,)),
            "linear_fc1.weight": ("w1", (wide, wide)), "linear_fc1.bias": ("b1", (wide,)),
            "linear_fc2.weight": ("w2", (out, wide)), "linear_fc2.bias": ("b2", (out,))}


def qwen3_tensors(cfg: Any) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[str, tuple[int, ...]]]]:
    """The tower's own tensors (HF name -> shape) and a deepstack merger's (as `merger_tensors`, under
    `deepstack_merger_list.N.`)."""
    E, wide = cfg.embed_dim, cfg.embed_dim * cfg.merge_unit
    own = {"patch_embed.proj.bias": (E,), "pos_embed.weight": (cfg.num_position_embeddings, E)}
    return own, merger_tensors(wide, wide, cfg.out_hidden_size)


def load_qwen3_extras(cfg: Any, found: dict[str, np.ndarray], dtype: Any) -> dict[str, Any]:
    """`QwenVisionParams`' Qwen3-VL fields from the checked tensors, in `dtype` (matrices stored [in, out])."""
    deep, n = qwen3_tensors(cfg)[1], len(cfg.deepstack_visual_indexes)

    def stacked(name: str, shape: tuple[int, ...]) -> jax.Array:
        a = np.stack([found[f"deepstack_merger_list.{i}.{name}"] for i in range(n)])
        return jnp.asarray(np.swapaxes(a, -1, -2) if len(shape) == 2 else a, dtype)

    return dict(extra={"patch_b": jnp.asarray(found["patch_embed.proj.bias"], dtype),
                       "pos_embed": jnp.asarray(found["pos_embed.weight"], dtype)},
                deep={key: stacked(name, shape) for name, (key, shape) in deep.items()} if n else None)


def expected_qwen3(cfg: Any) -> dict[str, tuple[int, ...]]:
    """Every Qwen3-VL-only tensor's HF name (under `visual.`) and shape."""
    own, deep = qwen3_tensors(cfg)
    return own | {f"deepstack_merger_list.{i}.{name}": shape for i in range(len(cfg.deepstack_visual_indexes))
                  for name, (_, shape) in deep.items()}


def qwen3_extra_tensors(params: Any, cfg: Any, prefix: str, host) -> list[tuple[str, np.ndarray]]:
    """The Qwen3-VL-only weights back under their HF names."""
    out = [(prefix + "patch_embed.proj.bias", host(params.extra["patch_b"])),
           (prefix + "pos_embed.weight", host(params.extra["pos_embed"]))]
    for name, (key, shape) in qwen3_tensors(cfg)[1].items():
        stacked = host(params.deep[key]) if params.deep is not None else ()
        out += [(f"{prefix}deepstack_merger_list.{i}.{name}", a.T if len(shape) == 2 else a)
                for i, a in enumerate(stacked)]
    return out


def position_taps(cfg: Any, pos: np.ndarray, grids: Sequence[tuple[int, int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """The 4 (row, column) cells of the learned grid each patch reads and their bilinear weights, as transformers'
    `interpolate(mode="bilinear", align_corners=True)` resamples the grid to the image's (h, w) patches: indices
    into the flattened grid [N, 4] int32 and weights [N, 4] float32, for patches at pos [N, 2] (`qwen_layout`)."""
    side = math.isqrt(cfg.num_position_embeddings)
    sizes = np.concatenate([np.tile([[h, w]], (t * h * w, 1)) for t, h, w in grids])  # [N, 2]
    src = pos.astype(np.float32) * np.float32(side - 1) / np.maximum(sizes - 1, 1).astype(np.float32)
    floor = np.floor(src)
    taps = np.clip(floor[..., None].astype(np.int64) + np.arange(2), 0, side - 1)  # [N, 2 axes, 2 taps]
    weights = np.clip(1.0 - np.abs(src[..., None] - floor[..., None] - np.arange(2)), 0.0, None)
    index = taps[:, 0, :, None] * side + taps[:, 1, None, :]  # [N, 2 (row tap), 2 (column tap)]
    weight = weights[:, 0, :, None] * weights[:, 1, None, :]
    return index.reshape(-1, 4).astype(np.int32), weight.reshape(-1, 4).astype(np.float32)


def embed_positions(params: Any, x: jax.Array, taps: jax.Array, weights: jax.Array) -> jax.Array:
    """Patches x [B, E] (already embedded) with the patch embedding's bias and their resampled position
    embeddings added."""
    pos = (params.extra["pos_embed"][taps].astype(jnp.float32) * weights[..., None]).sum(axis=1)  # (as transformers)
    return x + params.extra["patch_b"] + pos.astype(x.dtype)
