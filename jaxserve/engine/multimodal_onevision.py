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
from jaxserve.engine.multimodal import ImageEncoder, PreparedImage, PreparedVideo, cache_key
from jaxserve.engine.placeholders import expand_by_kind, expand_media
from jaxserve.images import _pil, _rgb, load_image, pixels_digest
from jaxserve.models.vision_anyres import bilinear
from jaxserve.videos import FrameVideoProcessor, VideoRef, read_video

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # transformers' default `image_mean` for the processor


@dataclass(frozen=True)
class OnevisionImage(PreparedImage):
    """An image prepared both ways: `pixels` its anyres crops [1 + n, C, S, S] (a prompt's only image), `square` the
    image padded to a square in one crop [C, S, S] (an image among several)."""

    square: np.ndarray


class OnevisionImageEncoder(ImageEncoder):
    """The vision side of a LLaVA-OneVision model: a SigLIP tower, the projector and the newline embedding; videos
    too (`video_processor`): each frame one crop, its features pooled to half the grid a side, then one newline."""

    video_processor: FrameVideoProcessor | None = None

    def prepare(self, source: Any) -> PreparedImage:
        """An image read, cut into its anyres crops and padded to its square (`OnevisionImage`)."""
        if isinstance(source, PreparedImage):
            return source
        if isinstance(source, VideoRef):
            return self.prepare_video(source.source)
        image = load_image(source, self.allowed_local_path)
        pixels, size = self.pixels(image), image.size[::-1]
        read = _rgb(image) if self.processor.convert_rgb else image
        side = max(read.size)
        mean = self.processor.source.get("image_mean", _CLIP_MEAN) if self.processor.source else _CLIP_MEAN
        padded = _pil().new(read.mode, (side, side), tuple(int(x * 255) for x in mean)[:len(read.getbands())])
        padded.paste(read, ((side - read.width) // 2, (side - read.height) // 2))
        return OnevisionImage(pixels, size, pixels_digest(pixels, size), self.processor.whole(padded))

    @property
    def video_token_id(self) -> int:
        """`<video>`: a video's placeholder, one per token of its pooled frames and its newline."""
        return int(self.hf_config.get("video_token_index", self.hf_config.get("video_token_id", 151647)))

    def prepare_video(self, source: Any) -> PreparedVideo:
        """A video (anything `videos.load_video` reads) read, its frames sampled and processed one crop each."""
        if isinstance(source, PreparedVideo):
            return source
        video = read_video(self.video_processor, source, self.allowed_local_path, self.video_frames)
        frames, size = self.video_processor(video.frames), video.frames.shape[1:3]
        return PreparedVideo(frames, size, pixels_digest(frames, size), (len(frames), 1, 1), 1.0)

    def _views(self, images: Sequence[PreparedImage]) -> list[PreparedImage]:
        """What the decoder sees of each image: its anyres crops when it is the prompt's only image, else its square;
        of a video, itself."""
        stills = [im for im in images if not isinstance(im, PreparedVideo)]
        if len(stills) == 1:
            return [im if isinstance(im, PreparedVideo) else PreparedImage(im.pixels, im.size, im.digest)
                    for im in images]
        return [im if isinstance(im, PreparedVideo) else
                PreparedImage(im.square[None], im.size, hashlib.sha256(im.digest + b"square").digest())
                for im in images]

    def num_tokens(self, image: PreparedImage) -> int:
        if isinstance(image, PreparedVideo):  # each frame pooled 2 x 2 (rounding up), then one newline
            return len(image.pixels) * (-(-self.cfg.image_size // self.cfg.patch_size // 2)) ** 2 + 1
        if image.pixels.shape[0] == 1:
            return self.cfg.tokens_per_image + 1
        return super().num_tokens(image)

    def _expand(self, ids: Sequence[int], items: Sequence[PreparedImage]) -> tuple[list[int], list, list]:
        return expand_by_kind(ids, self._views(items), lambda x: isinstance(x, PreparedVideo), self.cfg.image_token_id,
                              self.video_token_id, self.num_tokens, expand_media)

    def layout(self, ids: Sequence[int], images: Sequence[PreparedImage]) -> tuple[list[int], list[tuple[int, int]]]:
        return self._expand(ids, images)[:2]

    def prompt(self, ids: Sequence[int], images: Sequence[Any]) -> tuple[list[int], ImagePrompt]:
        out, spans, views = self._expand(ids, [self.prepare(image) for image in images])
        return out, ImagePrompt(spans, [cache_key(v.digest) for v in views], False, views, self._embeds)

    def _encode_pixels(self, image: PreparedImage) -> np.ndarray:
        newline = np.asarray(self.params.newline)
        if isinstance(image, PreparedVideo):  # each frame's features pooled (bilinear) to half its grid, rounding up
            feats = np.asarray(self._encode(self.params, pixels=image.pixels))
            g = self.cfg.image_size // self.cfg.patch_size
            h = -(-g // 2)
            pooled = [bilinear(f.reshape(g, g, -1), h, h).reshape(h * h, -1).astype(f.dtype) for f in feats]
            return np.concatenate([*pooled, newline.astype(feats.dtype)[None]])
        if image.pixels.shape[0] > 1:
            return super()._encode_pixels(image)
        feats = np.asarray(self._encode(self.params, pixels=image.pixels)[0])
        return np.concatenate([feats, np.asarray(self.params.newline, feats.dtype)[None]])

