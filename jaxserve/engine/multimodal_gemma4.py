"""Gemma 4's images in an engine's requests.

A chat template writes `<|image|>` where an image goes; it becomes `<|image>` (begin), the image's soft tokens (as
many as its resized size has 3 x 3 squares of patches, so they depend on its size) and `<image|>` (end), as
transformers' processor writes them. Where the language model's config says so (`use_bidirectional_attention`
"vision"), its windowed layers attend an image's tokens to each other both ways (its full-attention layers
causally): each image then runs in one prefill chunk. The tower runs on an image's patches padded to the processor's
most (one compiled shape), the padding masked."""

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
from jaxserve.images import checked_patches
from jaxserve.images_gemma4 import Gemma4ImageProcessor
from jaxserve.models.vision_gemma4 import Gemma4VisionConfig, gemma4_encode, gemma4_vision_tensors


class Gemma4ImageEncoder(ImageEncoder):
    """Gemma 4's vision side on the device: its processor, tower and projection."""

    cfg: Gemma4VisionConfig
    processor: Gemma4ImageProcessor

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._encode = jax.jit(functools.partial(gemma4_encode, cfg=self.cfg))

    @property
    def placeholder_token_id(self) -> int:
        return self.cfg.image_token_id

    def warmup(self) -> float:
        """Compile the tower for the processor's most patches (every image runs padded to them)."""
        t0 = time.perf_counter()
        self._encode_pixels(PreparedImage(np.zeros((self.cfg.pooling ** 2, self.cfg.patch_dim), np.float32),
                                          (self.processor.pooling * self.processor.patch_size,) * 2, b""))
        return time.perf_counter() - t0

    def num_tokens(self, image: PreparedImage) -> int:
        return self.processor.soft_tokens(image.size)

    def pixels(self, image: Any) -> np.ndarray:
        return checked_patches(self.processor(image), self.cfg.patch_dim)

    def expand(self, ids: Sequence[int], counts: Sequence[Sequence[int]]) -> tuple[list[int], list[tuple[int, int]]]:
        """Each `<|image|>` as `<|image>`, the image's soft tokens and `<image|>`."""
        cfg = self.cfg
        at = [i for i, t in enumerate(ids) if t == cfg.image_token_id]
        if len(at) != len(counts):
            raise ValueError(f"the prompt has {len(at)} image placeholder(s) (token {cfg.image_token_id}) for "
                             f"{len(counts)} image(s): put one placeholder where each image goes")
        out: list[int] = []
        spans: list[tuple[int, int]] = []
        prev = 0
        for i, (n,) in zip(at, counts, strict=True):
            out.extend(ids[prev:i])
            out.append(cfg.boi_token_id)
            spans.append((len(out), n))
            out.extend([cfg.image_token_id] * n + [cfg.eoi_token_id])
            prev = i + 1
        return out + list(ids[prev:]), spans

    def _encode_pixels(self, image: PreparedImage) -> np.ndarray:
        """The image's soft tokens [n, E]: the tower over its patches padded to the processor's most."""
        most, n = self.processor.max_patches, image.pixels.shape[0]
        patches = np.zeros((most, self.cfg.patch_dim), np.float32)
        positions = np.full((most, 2), -1, np.int32)
        patches[:n], positions[:n] = image.pixels, self.processor.positions(image.size)
        out = self._encode(self.params, patches=jnp.asarray(patches), positions=jnp.asarray(positions))
        return np.asarray(out[:n // self.cfg.pooling ** 2])

    def checkpoint_tensors(self, text: Iterable[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
        """The whole model's tensors as the Hub lays them out: the language model's under `model.language_model.`,
        the tower's and projection's after them (`jaxserve convert`)."""
        nested = ((f"model.language_model.{n.removeprefix('model.')}" if n.startswith("model.") else n, t)
                  for n, t in text)
        return itertools.chain(nested, gemma4_vision_tensors(self.params, self.cfg), self.unused.items())
