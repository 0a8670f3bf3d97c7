"""InternVL's images in an engine's requests. An image is cut into square tiles (`images_internvl`), each tile
`tokens_per_tile` tokens (256 for InternVL3's 448-pixel tiles); a chat template writes `<IMG_CONTEXT>` where an image
goes, which becomes `<img>`, the image's tiles' `<IMG_CONTEXT>` tokens, `</img>`, as InternVL's processor writes it.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.engine.multimodal import ImageEncoder, PreparedImage
from jaxserve.engine.placeholders import expand_placeholders, wrap_placeholders
from jaxserve.images import ImageError
from jaxserve.images_internvl import InternVLImageProcessor
from jaxserve.models.vision_internvl import InternVisionConfig, encode_internvl, internvl_vision_tensors


class InternVLImageEncoder(ImageEncoder):
    """The vision side of an InternVL model on the device: its processor, InternViT and projector."""

    cfg: InternVisionConfig
    processor: InternVLImageProcessor

    def __init__(self, cfg: InternVisionConfig, *args: Any, **kwargs: Any):
        super().__init__(cfg, *args, **kwargs)
        self._encode = jax.jit(functools.partial(encode_internvl, cfg=cfg))

    def warmup(self) -> float:
        """Compile the tower for a tile (every image runs tile by tile)."""
        t0, S = time.perf_counter(), self.cfg.image_size
        jax.block_until_ready(self._encode(self.params, tiles=jnp.zeros((1, self.cfg.num_channels, S, S))))
        return time.perf_counter() - t0

    @functools.cached_property
    def _marks(self) -> tuple[int, int]:
        """`<img>` and `</img>`: the tokens around an image's."""
        marks = [self.tokenizer.encode(text) for text in ("<img>", "</img>")]
        if any(len(m) != 1 for m in marks):
            raise ImageError(f"InternVL's tokenizer must have <img> and </img> as tokens, it reads them as {marks}")
        return marks[0][0], marks[1][0]

    def views(self, image: PreparedImage) -> list[PreparedImage]:
        return [image]

    def num_tokens(self, image: PreparedImage) -> int:
        return image.pixels.shape[0] * self.cfg.tokens_per_tile

    def pixels(self, image: Any) -> np.ndarray:
        """One image (read) as its tiles' normalized pixels [n, C, S, S]."""
        pixels = self.processor(image)
        S = self.cfg.image_size
        if pixels.ndim != 4 or pixels.shape[1:] != (self.cfg.num_channels, S, S):
            raise ImageError(f"the image processor made pixels of shape {pixels.shape}; the vision tower takes tiles "
                             f"of {(self.cfg.num_channels, S, S)}")
        return pixels

    def layout(self, ids: Sequence[int], images: Sequence[PreparedImage]) -> tuple[list[int], list[tuple[int, int]]]:
        counts = [self.num_tokens(image) for image in images]
        return expand_placeholders(wrap_placeholders(ids, self.cfg.image_token_id, counts, *self._marks),
                                   self.cfg.image_token_id, counts)

    def _encode_pixels(self, image: PreparedImage) -> np.ndarray:
        # One tile at a time: one compiled tower for any number of tiles.
        return np.concatenate([np.asarray(self._encode(self.params, tiles=jnp.asarray(t)[None])[0])
                               for t in image.pixels])

    def checkpoint_tensors(self, text: Iterable[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
        """The whole model's tensors as transformers lays out InternVL's: the language model's under
        `model.language_model.` (its head as `lm_head.`), the vision side's under `model.vision_tower.` and
        `model.multi_modal_projector.`."""
        nested = ((f"model.language_model.{n.removeprefix('model.')}" if n.startswith("model.") else n, t)
                  for n, t in text)
        return itertools.chain(nested, internvl_vision_tensors(self.params, self.cfg))
