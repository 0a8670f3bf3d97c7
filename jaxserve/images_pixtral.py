"""Pixtral's image processor (transformers' `PixtralImageProcessor`, its PIL version) step for step, for Mistral 3 and
LLaVA over a Pixtral tower: RGB (transparency over white), a resize that scales the image down (never up) until it
fits `longest_edge` and then rounds each side up to a multiple of the patch, a rescale and a per-channel
normalization. One image comes out whole, [C, H, W]: no padding (transformers pads only to batch several).

The patch the sides are rounded to is the processor's `patch_size` times the model's `spatial_merge_size`, as
`PixtralProcessor` passes it (Mistral 3's `preprocessor_config.json` says 14; its images are cut at 28 pixels).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxserve.errors import UnsupportedModelError
from jaxserve.images import ImageError, _pil, _rgb, scaled_pixels
from jaxserve.images_qwen2 import _CLIP_MEAN, _CLIP_STD

_KINDS = ("PixtralImageProcessor",)


def _pair(value: Any, what: str) -> tuple[int, int]:
    """(height, width) from an int or a {"height", "width"} dict."""
    if isinstance(value, dict):
        if set(value) != {"height", "width"}:
            raise UnsupportedModelError(f"Pixtral image processor {what} {value}: expected height and width")
        return int(value["height"]), int(value["width"])
    return int(value), int(value)


@dataclass(frozen=True)
class PixtralImageProcessor:
    """A Pixtral image processor's settings (`preprocessor_config.json`) and the model's merge size."""

    longest: tuple[int, int]  # the most (height, width) an image is scaled down to fit
    patch: tuple[int, int]  # (height, width) the sides are rounded up to multiples of: patch_size x merge
    resample: int
    resize: bool
    rescale: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...]
    convert_rgb: bool
    source: dict[str, Any] | None = field(default=None, compare=False)  # the config it was read from

    @classmethod
    def from_dict(cls, config: dict[str, Any], spatial_merge_size: int = 1) -> PixtralImageProcessor:
        """The processor a config describes, its sides in multiples of `patch_size * spatial_merge_size` (pass the
        model's merge size: `PixtralVisionConfig.spatial_merge_size`); a setting left out or null is transformers'
        default (`longest_edge` 1024, patches of 16, bicubic, CLIP's mean and std)."""
        d = {k: v for k, v in config.items() if v is not None}
        kind = d.get("image_processor_type", "PixtralImageProcessor").removesuffix("Fast").removesuffix("Pil")
        if kind not in _KINDS:
            raise ImageError(f"image processor {kind!r} is not Pixtral's (supported: {', '.join(_KINDS)})")
        resample = int(d.get("resample", 3))
        if resample not in {int(r) for r in _pil().Resampling}:
            raise UnsupportedModelError(f"image processor resample {resample} is not a PIL resampling filter")
        size = d.get("size", {"longest_edge": 1024})
        if isinstance(size, dict) and "longest_edge" in size:
            longest = (int(size["longest_edge"]),) * 2
        else:
            longest = _pair(size, "size")
        ph, pw = _pair(d.get("patch_size", 16), "patch_size")
        mean, std = tuple(d.get("image_mean", _CLIP_MEAN)), tuple(d.get("image_std", _CLIP_STD))
        if len(mean) != 3 or len(std) != 3:
            raise UnsupportedModelError(f"image_mean {mean} and image_std {std} must have one value per channel")
        if min(*longest, ph, pw, spatial_merge_size) < 1:
            raise UnsupportedModelError(f"Pixtral image processor size {size} and patch_size {ph} x {pw} must be "
                                        "positive")
        return cls(
            longest=longest, patch=(ph * spatial_merge_size, pw * spatial_merge_size), resample=resample,
            resize=bool(d.get("do_resize", True)),
            rescale=float(d.get("rescale_factor", 1 / 255)) if d.get("do_rescale", True) else None,
            mean=mean if d.get("do_normalize", True) else None, std=std,
            convert_rgb=bool(d.get("do_convert_rgb", True)), source=dict(config))

    def resized_size(self, size: tuple[int, int]) -> tuple[int, int]:
        """The (height, width) in pixels an image of (height, width) `size` is resized to: scaled down (rounding
        down) by the one ratio that fits it in `longest`, then each side rounded up to a multiple of the patch."""
        height, width = size
        (ph, pw), (most_h, most_w) = self.patch, self.longest
        if not self.resize:
            if height % ph or width % pw:
                raise ImageError(f"an image of {height} x {width} pixels, with resizing off, must have sides that "
                                 f"are multiples of {ph} x {pw}")
            return height, width
        ratio = max(height / most_h, width / most_w)
        if ratio > 1:
            height, width = math.floor(height / ratio), math.floor(width / ratio)
        if height < 1 or width < 1:
            raise ImageError(f"an image of {size[0]} x {size[1]} pixels is too long to fit in {most_h} x {most_w} "
                             "with a side of at least one pixel")
        return -(-height // ph) * ph, -(-width // pw) * pw

    def __call__(self, image) -> np.ndarray:
        """A PIL image as float32 pixels [C, H, W], H and W from `resized_size`."""
        image = _rgb(image) if self.convert_rgb else image
        size = self.resized_size((image.height, image.width))
        pixels = scaled_pixels(image, size, self.resample, self.rescale, self.mean, self.std)
        return pixels
