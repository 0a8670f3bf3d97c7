"""Idefics3's and SmolVLM's images in an engine's requests. The chat template writes `<image>` where an image goes;
it becomes the image's layout as transformers' processor writes it: for each tile, row by row,
`<fake_token_around_image><row_r_col_c>` and the tile's image tokens, a newline after each row (two after the last),
then `<fake_token_around_image><global-img>`, the global view's image tokens, `<fake_token_around_image>`; an image of
one tile is that last part alone. The marks are text (the prefix cache keys them as tokens); the image tokens take the
tiles' embeddings, in order.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from jaxserve.engine.image_prompt import ImagePrompt
from jaxserve.engine.multimodal import PreparedImage
from jaxserve.engine.multimodal_tiles import TileImageEncoder
from jaxserve.engine.placeholders import expand_layouts
from jaxserve.images import ImageError
from jaxserve.images_idefics3 import Idefics3ImageProcessor
from jaxserve.models.vision import vision_tensors


class Idefics3ImageEncoder(TileImageEncoder):
    """The vision side of an Idefics3 or SmolVLM model: its SigLIP tower and connector."""

    processor: Idefics3ImageProcessor

    @functools.lru_cache(maxsize=256)  # noqa: B019 - the encoder lives as long as its engine
    def _mark(self, text: str) -> int:
        ids = self.tokenizer.encode(text)
        if len(ids) != 1:
            raise ImageError(f"the tokenizer must have {text} as a token for Idefics3's image layout, it reads {ids}")
        return ids[0]

    def image_layout(self, image: PreparedImage) -> list[int]:
        """The tokens an image stands as in a prompt (see the module's docstring)."""
        rows, cols = self.processor.grid(image.size)
        fake, seq = self._mark("<fake_token_around_image>"), [self.cfg.image_token_id] * self.cfg.tokens_per_image
        out: list[int] = []
        for r in range(rows):
            for c in range(cols):
                out += [fake, self._mark(f"<row_{r + 1}_col_{c + 1}>"), *seq]
            out += self.tokenizer.encode("\n" if r < rows - 1 else "\n\n")
        return out + [fake, self._mark("<global-img>"), *seq, fake]

    def num_tokens(self, image: PreparedImage) -> int:
        return len(self.image_layout(image))

    def layout(self, ids: Sequence[int], images: Sequence[PreparedImage]) -> tuple[list[int], list[tuple[int, int]]]:
        return expand_layouts(ids, [self.image_layout(image) for image in images], self.cfg.image_token_id)

    def prompt(self, ids: Sequence[int], images: Sequence[Any]) -> tuple[list[int], ImagePrompt]:
        out, prompt = super().prompt(ids, images)
        prompt.takes = [np.asarray(out[first:first + n]) == self.cfg.image_token_id for first, n in prompt.spans]
        return out, prompt

    def checkpoint_tensors(self, text: Iterable[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
        """The whole model's tensors as transformers lays out Idefics3's and SmolVLM's: the language model's under
        `model.text_model.` (its head as `lm_head.`), the tower's under `model.vision_model.`, the connector's under
        `model.connector.`."""
        nested = ((f"model.text_model.{n.removeprefix('model.')}" if n.startswith("model.") else n, t)
                  for n, t in text)
        return itertools.chain(nested, vision_tensors(self.params, self.cfg))
