"""Idefics3's and SmolVLM's image processor (transformers' `Idefics3ImageProcessor` / `SmolVLMImageProcessor`, their
PIL versions) step for step: RGB; the image resized so its longest side is `size["longest_edge"]` (the other side
by its aspect, rounded up to even; within 4096 pixels); with splitting on (`do_image_splitting`), resized again so
both sides are multiples of the tile (`max_image_size["longest_edge"]`), cut into tiles row by row and followed by
the whole image resized to one tile (the global view), or, when it is one tile already, that tile alone; with
splitting off, resized to one tile. Every resize is PIL's, with `resample` (Lanczos by default), on 8-bit pixels;
each tile is then rescaled and normalized.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxserve.errors import UnsupportedModelError
from jaxserve.images import ImageError, _pil, _rgb, scaled_pixels

_KINDS = ("Idefics3ImageProcessor", "SmolVLMImageProcessor")
MAX_SIDE = 4096  # transformers' bound on a resized image's sides


def longest_to(height: int, width: int, longest: int) -> tuple[int, int]:
    """transformers' `get_resize_output_image_size`: the longest side `longest`, the other by the aspect (rounded down,
    then up to even), both within MAX_SIDE and at least 1."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_SIDE:
        width, height = MAX_SIDE, int(MAX_SIDE / aspect)
    elif height > width and height > MAX_SIDE:
        height, width = MAX_SIDE, int(MAX_SIDE * aspect)
    return max(height, 1), max(width, 1)


def tiled(height: int, width: int, tile: int) -> tuple[int, int]:
    """transformers' `resize_for_vision_encoder`: the longer side up to a multiple of the tile, the other by the
    aspect, then up to a multiple too."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


@dataclass(frozen=True)
class Idefics3ImageProcessor:
    """An Idefics3 / SmolVLM image processor's settings (`preprocessor_config.json`)."""

    longest: int | None  # `size["longest_edge"]` (None: no first resize)
    tile: int  # `max_image_size["longest_edge"]`: the tower's input side
    split: bool
    resample: int
    rescale: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...]
    convert_rgb: bool
    source: dict[str, Any] | None = field(default=None, compare=False)

    @classmethod
    def from_dict(cls, config: dict[str, Any], tile: int) -> Idefics3ImageProcessor:
        """The processor a config describes (`tile`: the tower's image size, which `max_image_size` must be); what
        it leaves out is transformers' default."""
        d = {k: v for k, v in config.items() if v is not None}
        kind = str(d.get("image_processor_type", "Idefics3ImageProcessor")).removesuffix("Fast").removesuffix("Pil")
        if kind not in _KINDS:
            raise ImageError(f"image processor {kind!r} is not Idefics3's (supported: {', '.join(_KINDS)})")
        most = dict(d.get("max_image_size", {"longest_edge": 364})).get("longest_edge")
        if most != tile:
            raise UnsupportedModelError(f"image processor max_image_size {d.get('max_image_size')}: the vision tower "
                                        f"takes {tile} x {tile} tiles")
        resample = int(d.get("resample", 1))
        if resample not in {int(r) for r in _pil().Resampling}:
            raise UnsupportedModelError(f"image processor resample {resample} is not a PIL resampling filter")
        size = dict(d.get("size", {"longest_edge": 4 * 364}))
        if "longest_edge" not in size:
            raise UnsupportedModelError(f"image processor size {size}: only longest_edge is supported")
        return cls(longest=int(size["longest_edge"]) if d.get("do_resize", True) else None, tile=tile,
                   split=bool(d.get("do_image_splitting", True)), resample=resample,
                   rescale=float(d.get("rescale_factor", 1 / 255)) if d.get("do_rescale", True) else None,
                   mean=tuple(d.get("image_mean", (0.5, 0.5, 0.5))) if d.get("do_normalize", True) else None,
                   std=tuple(d.get("image_std", (0.5, 0.5, 0.5))), convert_rgb=bool(d.get("do_convert_rgb", True)),
                   source=dict(config))

    def grid(self, size: tuple[int, int]) -> tuple[int, int]:
        """The (rows, columns) of tiles an image of (height, width) `size` is cut into; (0, 0): one tile, no global
        view."""
        h, w = longest_to(*size, self.longest) if self.longest else size
        if not self.split:
            return 0, 0
        return self.grid_of_resized(*tiled(h, w, self.tile))

    def __call__(self, image) -> np.ndarray:
        """A PIL image as its tiles' (then its global view's) normalized pixels [n, C, tile, tile]."""
        image = _rgb(image) if self.convert_rgb else image
        Image, T = _pil(), self.tile
        resize = lambda im, h, w: im if (im.height, im.width) == (h, w) else \
            im.resize((w, h), resample=Image.Resampling(self.resample))  # noqa: E731
        if self.longest:
            image = resize(image, *longest_to(image.height, image.width, self.longest))
        norm = lambda im: scaled_pixels(im, (T, T), self.resample, self.rescale, self.mean, self.std)  # noqa: E731
        if not self.split:
            return norm(resize(image, T, T))[None]
        image = resize(image, *tiled(image.height, image.width, T))
        rows, cols = self.grid_of_resized(image.height, image.width)
        if not rows:
            return norm(image)[None]
        tiles = [image.crop((c * T, r * T, (c + 1) * T, (r + 1) * T)) for r in range(rows) for c in range(cols)]
        return np.stack([norm(t) for t in tiles] + [norm(resize(image, T, T))])

    def grid_of_resized(self, height: int, width: int) -> tuple[int, int]:
        """The (rows, columns) of tiles of an image resized to whole tiles; (0, 0) for one tile."""
        T = self.tile
        return ((height - T) // T + 1, (width - T) // T + 1) if max(height, width) > T else (0, 0)
