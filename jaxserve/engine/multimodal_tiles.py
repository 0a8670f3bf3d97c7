"""What the encoders of tiled images share (InternVL's, Idefics3's): an image is square tiles [n, C, S, S], each the
tower's input, encoded one at a time (one compiled tower for any number of tiles), the embeddings in tile order."""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.engine.multimodal import ImageEncoder, PreparedImage
from jaxserve.images import ImageError


class TileImageEncoder(ImageEncoder):
    """An image-text model's vision side whose images are square tiles of the tower's input size."""

    def warmup(self) -> float:
        """Compile the tower for a tile (every image runs tile by tile)."""
        t0, S = time.perf_counter(), self.cfg.image_size
        jax.block_until_ready(self._encode(self.params, pixels=jnp.zeros((1, self.cfg.num_channels, S, S))))
        return time.perf_counter() - t0

    def views(self, image: PreparedImage) -> list[PreparedImage]:
        return [image]

    def pixels(self, image: Any) -> np.ndarray:
        """One image (read) as its tiles' normalized pixels [n, C, S, S]."""
        pixels = self.processor(image)
        S = self.cfg.image_size
        if pixels.ndim != 4 or pixels.shape[1:] != (self.cfg.num_channels, S, S):
            raise ImageError(f"the image processor made pixels of shape {pixels.shape}; the vision tower takes tiles "
                             f"of {(self.cfg.num_channels, S, S)}")
        return pixels

    def _encode_pixels(self, image: PreparedImage) -> np.ndarray:
        return np.concatenate([np.asarray(self._encode(self.params, pixels=jnp.asarray(t)[None])[0])
                               for t in image.pixels])
