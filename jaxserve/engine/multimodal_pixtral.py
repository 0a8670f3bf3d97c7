"""Pixtral-tower images in an engine's requests (Mistral Small 3.x: `Mistral3ForConditionalGeneration`; Pixtral in
LLaVA's form).

An image keeps its aspect and takes a token per patch (per 2 x 2 patches after Mistral 3's merger): it is laid out
as its rows of `[IMG]` tokens, each row ended by `[IMG_BREAK]` and the last by `[IMG_END]`, as Mistral's processor
writes it. The breaks and the end are text: they keep their own embeddings (`ImagePrompt.takes`), the `[IMG]`
tokens take the image's, row by row.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from jaxserve.engine.image_prompt import ImagePrompt
from jaxserve.engine.multimodal import ImageEncoder, PreparedImage
from jaxserve.engine.placeholders import expand_grids
from jaxserve.images import ImageError
from jaxserve.images_pixtral import PixtralImageProcessor
from jaxserve.models.vision_pixtral import (
    IMAGE_BREAK_TOKEN,
    IMAGE_END_TOKEN,
    PixtralVisionConfig,
    pixtral_encode,
    pixtral_grid,
    pixtral_prompt_tokens,
    pixtral_vision_tensors,
)


def pixtral_config(cfg: PixtralVisionConfig, tokenizer: Any) -> PixtralVisionConfig:
    """The config with the `[IMG_BREAK]` and `[IMG_END]` ids the model's tokenizer gives them (no config holds them;
    without a tokenizer, `skip_tokenizer_init`, they must be in the config)."""
    ids = {name: tokenizer.token_to_id(token) if tokenizer is not None else None for name, token in
           (("image_break_token_id", IMAGE_BREAK_TOKEN), ("image_end_token_id", IMAGE_END_TOKEN))}
    missing = [token for (name, i), token in zip(ids.items(), (IMAGE_BREAK_TOKEN, IMAGE_END_TOKEN), strict=True)
               if i is None and getattr(cfg, name) is None]
    if missing and tokenizer is None:
        raise ImageError(f"Pixtral's {' and '.join(missing)} ids are its tokenizer's: not with skip_tokenizer_init")
    if missing:
        raise ImageError(f"the tokenizer has no {' or '.join(missing)} token: a Pixtral image cannot be laid out")
    return dataclasses.replace(cfg, **{k: v for k, v in ids.items() if getattr(cfg, k) is None})


class PixtralImageEncoder(ImageEncoder):
    """The vision side of a Pixtral-tower model on the device: its processor, tower, merger and projector."""

    cfg: PixtralVisionConfig
    processor: PixtralImageProcessor

    def warmup(self) -> float:
        """Compile the tower for the smallest image (its bucket of patches); larger ones compile as they first come."""
        t0, side = time.perf_counter(), self.cfg.patch_size * self.cfg.spatial_merge_size
        pixtral_encode(self.params, self.cfg, np.zeros((self.cfg.num_channels, side, side), np.float32))
        return time.perf_counter() - t0

    def _grid(self, image: PreparedImage) -> tuple[int, int]:
        return pixtral_grid(self.cfg, image.pixels.shape[-2:])

    def num_tokens(self, image: PreparedImage) -> int:
        rows, cols = self._grid(image)
        return rows * (cols + 1)

    def pixels(self, image: Any) -> np.ndarray:
        """One image (read) as the tower's normalized pixels [C, H, W], its sides whole merged patches."""
        pixels = self.processor(image)
        unit = self.cfg.patch_size * self.cfg.spatial_merge_size
        if pixels.ndim != 3 or pixels.shape[0] != self.cfg.num_channels or pixels.shape[1] % unit or \
                pixels.shape[2] % unit:
            raise ImageError(f"the image processor made pixels of shape {pixels.shape}; the vision tower takes "
                             f"{self.cfg.num_channels} channels of sides that are multiples of {unit}")
        return pixels

    def layout(self, ids: Sequence[int], images: Sequence[PreparedImage]) -> tuple[list[int], list[tuple[int, int]]]:
        layouts = [pixtral_prompt_tokens(self.cfg, self._grid(im)) for im in images]
        return expand_grids(ids, layouts, self.cfg.image_token_id, self.cfg.image_end_token_id)

    def prompt(self, ids: Sequence[int], images: Sequence[Any]) -> tuple[list[int], ImagePrompt]:
        out, prompt = super().prompt(ids, images)
        prompt.takes = [np.asarray(out[first:first + n]) == self.cfg.image_token_id for first, n in prompt.spans]
        return out, prompt

    def _encode_pixels(self, image: PreparedImage) -> np.ndarray:
        return pixtral_encode(self.params, self.cfg, image.pixels)

    def checkpoint_tensors(self, text: Iterable[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
        """The whole model's tensors as the Hub lays out Mistral 3's and Pixtral's: the language model's nested in
        `language_model.`, then the tower's and projector's."""
        return itertools.chain(((f"language_model.{n}", t) for n, t in text), pixtral_vision_tensors(self.params,
                                                                                                      self.cfg))
