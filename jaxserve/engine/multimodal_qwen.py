"""Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's images in an engine's requests.

An image takes as many `<|image_pad|>` tokens as its resized size has merged patches (the processor keeps it
between `min_pixels` and `max_pixels`), so its tokens depend on its size, as LLaVA-NeXT's do. Its tokens turn by
their place in it (M-RoPE: temporal, row, column), and the text after it by the positions they did not take: the
prompt keeps each image's token grid (`ImagePrompt.grids`) for the steps' rotary offsets. A chat template writes
`<|vision_start|><|image_pad|><|vision_end|>` where an image goes; the one `<|image_pad|>` becomes the image's.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from jaxserve.engine.image_prompt import ImagePrompt
from jaxserve.engine.multimodal import ImageEncoder, PreparedImage
from jaxserve.images import ImageError
from jaxserve.images_qwen2 import QwenImageProcessor
from jaxserve.models.vision_qwen2 import (
    QwenVisionConfig,
    qwen_encode,
    qwen_token_grid,
    qwen_tokens,
    qwen_vision_tensors,
)


class QwenImageEncoder(ImageEncoder):
    """The vision side of a Qwen2-VL, Qwen2.5-VL or Qwen3-VL model on the device: its processor, tower and merger
    (and Qwen3-VL's deepstack mergers)."""

    cfg: QwenVisionConfig
    processor: QwenImageProcessor

    def warmup(self) -> float:
        """Compile the tower for the smallest image the processor makes (its bucket of patches); images in larger
        buckets compile as they first come."""
        t0 = time.perf_counter()
        side = self.processor.factor
        grid = self.processor.grid((side, side))
        self._encode_pixels(np.zeros((int(np.prod(grid)), self.cfg.patch_dim), np.float32), (side, side))
        return time.perf_counter() - t0

    def num_tokens(self, image: PreparedImage) -> int:
        return qwen_tokens(self.processor.grid(image.size), self.cfg)

    def pixels(self, image: Any) -> np.ndarray:
        """One image (read) as the tower's flattened patches [t * h * w, C * T * P * P]."""
        patches = self.processor(image)
        if patches.ndim != 2 or patches.shape[1] != self.cfg.patch_dim:
            raise ImageError(f"the image processor made patches of shape {patches.shape}; the vision tower takes "
                             f"{self.cfg.patch_dim} values a patch")
        return patches

    def prompt(self, ids: Sequence[int], images: Sequence[Any]) -> tuple[list[int], ImagePrompt]:
        out, prompt = super().prompt(ids, images)
        prompt.grids = [qwen_token_grid(self.processor.grid(image.size), self.cfg) for image in prompt.images]
        return out, prompt

    def _encode_pixels(self, pixels: np.ndarray, size: tuple[int, int]) -> np.ndarray:
        return qwen_encode(self.params, self.cfg, pixels, self.processor.grid(size))

    def checkpoint_tensors(self, text: Iterable[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
        """The whole model's tensors as the Hub lays out Qwen2-VL's (the language model's names as they are, the
        vision side's under `visual.`) or Qwen3-VL's (the language model's under `model.language_model.`, the
        vision side's under `model.visual.`)."""
        if self.cfg.variant == "qwen3_vl":
            nested = ((f"model.language_model.{n.removeprefix('model.')}" if n.startswith("model.") else n, t)
                      for n, t in text)
            return itertools.chain(nested, qwen_vision_tensors(self.params, self.cfg, prefix="model.visual."))
        return itertools.chain(text, qwen_vision_tensors(self.params, self.cfg, prefix="visual."))

