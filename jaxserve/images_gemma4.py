"""Gemma 4's image processor (transformers' `Gemma4ImageProcessor`, its PIL version) step for step: RGB, a resize
that keeps the aspect ratio to the largest sides, multiples of `pooling_kernel_size * patch_size`, holding at most
`max_soft_tokens * pooling_kernel_size^2` patches (an image too thin for that takes one square's side and as many
as its ratio gives, up to the longest side that budget allows), a rescale to [0, 1] (no normalization), then its
patches row by row, each patch's values over (row, column, channel). An image's soft tokens are its patches over
`pooling_kernel_size^2`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxserve.errors import UnsupportedModelError
from jaxserve.images import ImageError, _pil, _rgb, scaled_pixels

SOFT_TOKENS = (70, 140, 280, 560, 1120)  # the processor's choices of `max_soft_tokens`


@dataclass(frozen=True)
class Gemma4ImageProcessor:
    """A Gemma 4 image processor's settings (`preprocessor_config.json`, or `image_processor` in
    `processor_config.json`)."""

    patch_size: int
    max_soft_tokens: int
    pooling: int
    resample: int
    resize: bool
    rescale: float | None
    convert_rgb: bool
    source: dict[str, Any] | None = field(default=None, compare=False)

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> Gemma4ImageProcessor:
        """The processor a config describes (transformers' defaults for what it leaves out); a normalization other
        than none, or a `max_soft_tokens` the processor does not offer, is refused by name."""
        d = {k: v for k, v in config.items() if v is not None}
        kind = d.get("image_processor_type", "Gemma4ImageProcessor").removesuffix("Fast").removesuffix("Pil")
        if kind != "Gemma4ImageProcessor":
            raise ImageError(f"image processor {kind!r} is not Gemma 4's")
        soft = int(d.get("max_soft_tokens", 280))
        if soft not in SOFT_TOKENS:
            raise UnsupportedModelError(f"Gemma 4 max_soft_tokens {soft} is not one of {SOFT_TOKENS}")
        if d.get("do_normalize") and (list(d.get("image_mean", [0, 0, 0])) != [0, 0, 0]
                                      or list(d.get("image_std", [1, 1, 1])) != [1, 1, 1]):
            raise UnsupportedModelError("a Gemma 4 image processor that normalizes is not supported")
        resample = int(d.get("resample", 3))
        if resample not in {int(r) for r in _pil().Resampling}:
            raise UnsupportedModelError(f"image processor resample {resample} is not a PIL resampling filter")
        return cls(patch_size=int(d.get("patch_size", 16)), max_soft_tokens=soft,
                   pooling=int(d.get("pooling_kernel_size", 3)), resample=resample,
                   resize=bool(d.get("do_resize", True)),
                   rescale=float(d.get("rescale_factor", 1 / 255)) if d.get("do_rescale", True) else None,
                   convert_rgb=bool(d.get("do_convert_rgb", True)), source=dict(config))

    @property
    def max_patches(self) -> int:
        return self.max_soft_tokens * self.pooling ** 2

    def resized_size(self, size: tuple[int, int]) -> tuple[int, int]:
        """The (height, width) an image of (height, width) `size` is resized to."""
        height, width = size
        side = self.pooling * self.patch_size
        if not self.resize:
            if height % side or width % side or (height // self.patch_size) * (width // self.patch_size) \
                    > self.max_patches:
                raise ImageError(f"an image of {height} x {width} pixels, with resizing off, must have sides that are "
                                 f"multiples of {side} and at most {self.max_patches} patches")
            return height, width
        factor = math.sqrt(self.max_patches * self.patch_size ** 2 / (height * width))
        h, w = int(math.floor(factor * height / side)) * side, int(math.floor(factor * width / side)) * side
        longest = (self.max_patches // self.pooling ** 2) * side
        if h == 0 and w == 0:
            raise ImageError(f"an image of {height} x {width} pixels resizes to nothing")
        if h == 0:
            h, w = side, min(int(math.floor(width / height)) * side, longest)
        elif w == 0:
            h, w = min(int(math.floor(height / width)) * side, longest), side
        return h, w

    def grid(self, size: tuple[int, int]) -> tuple[int, int]:
        """The (rows, columns) of patches of an image of (height, width) `size` pixels."""
        h, w = self.resized_size(size)
        return h // self.patch_size, w // self.patch_size

    def soft_tokens(self, size: tuple[int, int]) -> int:
        rows, cols = self.grid(size)
        return rows * cols // self.pooling ** 2

    def __call__(self, image) -> np.ndarray:
        """A PIL image as float32 patches [rows * columns, P * P * 3]."""
        image = _rgb(image) if self.convert_rgb else image
        pixels = scaled_pixels(image, self.resized_size((image.height, image.width)), self.resample, self.rescale,
                               None, ())
        C, H, W = pixels.shape
        P = self.patch_size
        patches = pixels.reshape(C, H // P, P, W // P, P).transpose(1, 3, 2, 4, 0)
        return np.ascontiguousarray(patches.reshape((H // P) * (W // P), P * P * C), np.float32)

    def positions(self, size: tuple[int, int]) -> np.ndarray:
        """Each patch's (column, row) [rows * columns, 2], row by row."""
        rows, cols = self.grid(size)
        x, y = np.meshgrid(np.arange(cols), np.arange(rows), indexing="xy")
        return np.stack([x, y], axis=-1).reshape(rows * cols, 2).astype(np.int32)
