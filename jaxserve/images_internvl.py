"""InternVL's image processor (transformers' `GotOcr2ImageProcessor`, its PIL version, as InternVL's processor calls
it: cropping to tiles on) step for step: RGB, then the image resized to the grid of square tiles (from `min_patches`
to `max_patches` of them) whose shape is nearest its aspect ratio, cut into those tiles row by row, and (when there is
more than one) followed by the whole image resized to one tile (the thumbnail); each tile rescaled and normalized.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

from jaxserve.errors import UnsupportedModelError
from jaxserve.images import ImageError, _pil, _rgb, scaled_pixels

_KINDS = ("GotOcr2ImageProcessor",)
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@lru_cache(maxsize=16)
def _grids(least: int, most: int) -> tuple[tuple[int, int], ...]:
    """Every (columns, rows) of `least` to `most` tiles, fewest tiles first (ties in columns-then-rows order)."""
    grids = [(c, r) for c in range(1, most + 1) for r in range(1, most + 1) if least <= c * r <= most]
    return tuple(sorted(grids, key=lambda g: g[0] * g[1]))


def tile_grid(size: tuple[int, int], tile: int, least: int, most: int) -> tuple[int, int]:
    """transformers' `get_optimal_tiled_canvas`: the (columns, rows) whose aspect ratio is nearest the image's; on a
    tie, the later (more tiles) while the image's area is over half the tiles'."""
    height, width = size
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for c, r in _grids(least, most):
        diff = abs(aspect - c / r)
        if diff < best_diff:
            best, best_diff = (c, r), diff
        elif diff == best_diff and area > 0.5 * tile * tile * c * r:
            best = (c, r)
    return best


@dataclass(frozen=True)
class InternVLImageProcessor:
    """InternVL's image processor settings (`preprocessor_config.json`, InternVL's processor's tiling on)."""

    tile: int  # a tile's side in pixels
    crop: bool  # cut into tiles (`crop_to_patches`)
    min_tiles: int
    max_tiles: int
    resample: int
    rescale: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...]
    convert_rgb: bool
    source: dict[str, Any] | None = field(default=None, compare=False)

    @classmethod
    def from_dict(cls, config: dict[str, Any], tile: int, crop: bool = True) -> InternVLImageProcessor:
        """The processor a config describes (`tile`: the tower's image size, which its `size` must be); what it leaves
        out is transformers' default. `crop`: cut tiles (InternVL's processor turns them on whatever the file says;
        `--mm-processor-kwargs '{"crop_to_patches": false}'` turns them off)."""
        d = {k: v for k, v in config.items() if v is not None}
        kind = str(d.get("image_processor_type", "GotOcr2ImageProcessor")).removesuffix("Fast").removesuffix("Pil")
        if kind not in _KINDS:
            raise ImageError(f"image processor {kind!r} is not InternVL's (supported: {', '.join(_KINDS)})")
        size = d.get("size", {"height": tile, "width": tile})
        if (size.get("height"), size.get("width")) != (tile, tile):
            raise UnsupportedModelError(f"InternVL image processor size {size}: the vision tower takes {tile} x {tile} "
                                        "tiles")
        least, most = int(d.get("min_patches", 1)), int(d.get("max_patches", 12))
        if not 1 <= least <= most:
            raise UnsupportedModelError(f"InternVL image processor min_patches {least}, max_patches {most}: need "
                                        "1 <= min_patches <= max_patches")
        resample = int(d.get("resample", 3))
        if resample not in {int(r) for r in _pil().Resampling}:
            raise UnsupportedModelError(f"image processor resample {resample} is not a PIL resampling filter")
        mean, std = tuple(d.get("image_mean", _CLIP_MEAN)), tuple(d.get("image_std", _CLIP_STD))
        return cls(tile=tile, crop=crop, min_tiles=least, max_tiles=most,
                   resample=resample, rescale=float(d.get("rescale_factor", 1 / 255)) if d.get("do_rescale", True)
                   else None, mean=mean if d.get("do_normalize", True) else None, std=std,
                   convert_rgb=bool(d.get("do_convert_rgb", True)), source=dict(config))

    def num_tiles(self, size: tuple[int, int]) -> int:
        """The tiles an image of (height, width) `size` makes: its grid's, and the thumbnail when more than one."""
        if not self.crop or self.max_tiles == 1:
            return 1
        c, r = tile_grid(size, self.tile, self.min_tiles, self.max_tiles)
        return c * r + (c * r > 1)

    def __call__(self, image) -> np.ndarray:
        """A PIL image as its tiles' normalized pixels [n, C, tile, tile]."""
        image = _rgb(image) if self.convert_rgb else image
        S, Image = self.tile, _pil()
        norm = lambda im: scaled_pixels(im, (S, S), self.resample, self.rescale, self.mean, self.std)  # noqa: E731
        if not self.crop or self.max_tiles == 1:
            return norm(image)[None]
        c, r = tile_grid((image.height, image.width), S, self.min_tiles, self.max_tiles)
        whole = image.resize((c * S, r * S), resample=Image.Resampling(self.resample))
        tiles = [norm(whole.crop((i % c * S, i // c * S, (i % c + 1) * S, (i // c + 1) * S))) for i in range(c * r)]
        if len(tiles) > 1:
            tiles.append(norm(image))
        return np.stack(tiles)

