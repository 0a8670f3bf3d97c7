"""LLaVA-OneVision's images in an engine's requests. A prompt's one image is an anyres image (the whole image, then
its crops at the best pinpoint, unpadded, shrunk to about `max_crops` crops' features, each row ended by a newline
embedding: `models.vision_anyres`); each image of a prompt with several is the image padded to a square (with the
processor's mean colour) in one crop, its features and one newline embedding, as transformers' processor and model
make them (it cuts crops only when a prompt has one image).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxserve.engine.image_prompt import ImagePrompt
from jaxserve.engine.multimodal import ImageEncoder, PreparedImage, cache_key
from jaxserve.engine.placeholders import expand_placeholders
from jaxserve.images import _pil, _rgb, load_image, pixels_digest

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # transformers' default `image_mean` for the processor


@dataclass(frozen=True)
class OnevisionImage(PreparedImage):
    """An image prepared both ways: `pixels` its anyres crops [1 + n, C, S, S] (a prompt's only image), `square` the
    image padded to a square in one crop [C, S, S] (an image among several)."""

    square: np.ndarray


class OnevisionImageEncoder(ImageEncoder):
    """The vision side of a LLaVA-OneVision model: a SigLIP tower, the projector and the newline embedding."""

    def prepare(self, source: Any) -> PreparedImage:
        """An image read, cut into its anyres crops and padded to its square (`OnevisionImage`)."""
        if isinstance(source, PreparedImage):
            return source
        image = load_image(source, self.allowed_local_path)
        pixels, size = self.pixels(image), image.size[::-1]
        read = _rgb(image) if self.processor.convert_rgb else image
        side = max(read.size)
        mean = self.processor.source.get("image_mean", _CLIP_MEAN) if self.processor.source else _CLIP_MEAN
        padded = _pil().new(read.mode, (side, side), tuple(int(x * 255) for x in mean)[:len(read.getbands())])
        padded.paste(read, ((side - read.width) // 2, (side - read.height) // 2))
        return OnevisionImage(pixels, size, pixels_digest(pixels, size), self.processor.whole(padded))

    def _views(self, images: Sequence[PreparedImage]) -> list[PreparedImage]:
        """What the decoder sees of each image: its anyres crops when it is the prompt's only image, else its square."""
        if len(images) == 1:
            return [PreparedImage(images[0].pixels, images[0].size, images[0].digest)]
        return [PreparedImage(im.square[None], im.size, hashlib.sha256(im.digest + b"square").digest())
                for im in images]

    def num_tokens(self, image: PreparedImage) -> int:
        if image.pixels.shape[0] == 1:
            return self.cfg.tokens_per_image + 1
        return super().num_tokens(image)

    def layout(self, ids: Sequence[int], images: Sequence[PreparedImage]) -> tuple[list[int], list[tuple[int, int]]]:
        return expand_placeholders(ids, self.cfg.image_token_id, [self.num_tokens(v) for v in self._views(images)])

    def prompt(self, ids: Sequence[int], images: Sequence[Any]) -> tuple[list[int], ImagePrompt]:
        views = self._views([self.prepare(image) for image in images])
        out, spans = expand_placeholders(ids, self.cfg.image_token_id, [self.num_tokens(v) for v in views])
        return out, ImagePrompt(spans, [cache_key(v.digest) for v in views], False, views, self._embeds)

    def _encode_pixels(self, image: PreparedImage) -> np.ndarray:
        if image.pixels.shape[0] > 1:
            return super()._encode_pixels(image)
        feats = np.asarray(self._encode(self.params, pixels=image.pixels)[0])
        return np.concatenate([feats, np.asarray(self.params.newline, feats.dtype)[None]])

