"""Qwen2-VL's and Qwen2.5-VL's image processor (transformers' `Qwen2VLImageProcessor`, its PIL version) step for
step: RGB (transparency over white), a resize to sides that are multiples of `patch_size * merge_size` holding
between `min_pixels` and `max_pixels` pixels with the aspect kept as well as that allows (`smart_resize`), a rescale,
a per-channel normalization, and the cut into patches.

The patches come out flattened, [t * h * w, C * T * P * P], each over (channel, frame, row, column), the still image
repeated to the `temporal_patch_size` frames a video patch has. They are ordered so that each `merge x merge`
square of neighbouring patches is consecutive (the groups row by row, each group's patches row by row): the vision
tower's merger concatenates consecutive groups into one image token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxserve.errors import UnsupportedModelError
from jaxserve.images import ImageError, _pil, _rgb, scaled_pixels

_KINDS = ("Qwen2VLImageProcessor",)
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT = 200  # transformers refuses images longer than this many times their width (or the reverse)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' size rule: each side rounded to a multiple of `factor`, then both scaled down (rounding
    down) or up (rounding up) by one ratio when the area falls outside [min_pixels, max_pixels]."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ImageError(f"an image of {height} x {width} pixels is too long: Qwen2-VL's processor takes aspect "
                         f"ratios up to {MAX_ASPECT}")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


@dataclass(frozen=True)
class QwenImageProcessor:
    """A Qwen2-VL / Qwen2.5-VL image processor's settings (`preprocessor_config.json`)."""

    min_pixels: int
    max_pixels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    resample: int
    resize: bool
    rescale: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...]
    convert_rgb: bool
    source: dict[str, Any] | None = field(default=None, compare=False)  # the config it was read from

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> QwenImageProcessor:
        """The processor a config describes; a setting left out or null is transformers' default. `min_pixels` and
        `max_pixels` override `size`'s `shortest_edge` and `longest_edge`, as in transformers. Settings the
        processor has no use for (`do_center_crop`, the video ones) are ignored, as transformers' processor
        ignores them."""
        d = {k: v for k, v in config.items() if v is not None}
        kind = d.get("image_processor_type", "Qwen2VLImageProcessor").removesuffix("Fast").removesuffix("Pil")
        if kind not in _KINDS:
            raise ImageError(f"image processor {kind!r} is not Qwen2-VL's (supported: {', '.join(_KINDS)})")
        resample = int(d.get("resample", 3))
        if resample not in {int(r) for r in _pil().Resampling}:
            raise UnsupportedModelError(f"image processor resample {resample} is not a PIL resampling filter")
        size = dict(d.get("size", {}))
        extra = sorted(set(size) - {"shortest_edge", "longest_edge"})
        if extra:
            raise UnsupportedModelError(f"Qwen2-VL image processor size {size}: only shortest_edge and "
                                        "longest_edge (the least and most pixels) are supported")
        least = int(d.get("min_pixels", size.get("shortest_edge", 56 * 56)))
        most = int(d.get("max_pixels", size.get("longest_edge", 28 * 28 * 1280)))
        if not 0 < least <= most:
            raise UnsupportedModelError(f"Qwen2-VL image processor min_pixels {least} and max_pixels {most}: "
                                        "need 0 < min_pixels <= max_pixels")
        mean, std = tuple(d.get("image_mean", _CLIP_MEAN)), tuple(d.get("image_std", _CLIP_STD))
        if len(mean) != 3 or len(std) != 3:
            raise UnsupportedModelError(f"image_mean {mean} and image_std {std} must have one value per channel")
        return cls(
            min_pixels=least, max_pixels=most, patch_size=int(d.get("patch_size", 14)),
            temporal_patch_size=int(d.get("temporal_patch_size", 2)), merge_size=int(d.get("merge_size", 2)),
            resample=resample, resize=bool(d.get("do_resize", True)),
            rescale=float(d.get("rescale_factor", 1 / 255)) if d.get("do_rescale", True) else None,
            mean=mean if d.get("do_normalize", True) else None, std=std,
            convert_rgb=bool(d.get("do_convert_rgb", True)), source=dict(config))

    @property
    def factor(self) -> int:
        """Pixels per side of a merged patch: resized sides are multiples of it."""
        return self.patch_size * self.merge_size

    def resized_size(self, size: tuple[int, int]) -> tuple[int, int]:
        """The (height, width) in pixels an image of (height, width) `size` is resized to."""
        height, width = size
        if not self.resize:
            if height % self.factor or width % self.factor:
                raise ImageError(f"an image of {height} x {width} pixels, with resizing off, must have sides that "
                                 f"are multiples of {self.factor}")
            return height, width
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)

    def grid(self, size: tuple[int, int]) -> tuple[int, int, int]:
        """The (t, h, w) patch grid of an image of (height, width) `size` pixels: t is 1 for a still image."""
        height, width = self.resized_size(size)
        return 1, height // self.patch_size, width // self.patch_size

    def __call__(self, image) -> np.ndarray:
        """A PIL image as float32 patches [t * h * w, C * T * P * P] (see the module's docstring for the order)."""
        image = _rgb(image) if self.convert_rgb else image
        size = self.resized_size((image.height, image.width))
        pixels = scaled_pixels(image, size, self.resample, self.rescale, self.mean, self.std)
        return self.patches(pixels)

    def patches(self, pixels: np.ndarray) -> np.ndarray:
        """Processed pixels [C, H, W] cut into the flattened patches [h * w, C * T * P * P] of a still image."""
        C, H, W = pixels.shape
        P, m, T = self.patch_size, self.merge_size, self.temporal_patch_size
        h, w = H // P, W // P
        blocks = pixels.reshape(C, h // m, m, P, w // m, m, P).transpose(1, 4, 2, 5, 0, 3, 6)  # [.., C, P, P]
        frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], T, P, P))
        return np.ascontiguousarray(frames).reshape(h * w, C * T * P * P)
