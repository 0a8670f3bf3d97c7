"""InternVL's images and videos in an engine's requests. An image is cut into square tiles (`images_internvl`), each
tile `tokens_per_tile` tokens (256 for InternVL3's 448-pixel tiles); a chat template writes `<IMG_CONTEXT>` where an
image goes, which becomes `<img>`, the image's tiles' `<IMG_CONTEXT>` tokens, `</img>`, as InternVL's processor
writes it. A video's frames are a tile each; the template's `<video>` becomes "Frame1: " and the first frame's
`<img>`...`</img>`, then "\nFrame2: " and the second's, and so on. The text between takes no embeddings.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from jaxserve.engine.image_prompt import ImagePrompt
from jaxserve.engine.multimodal import PreparedImage, PreparedVideo, cache_key
from jaxserve.engine.multimodal_tiles import TileImageEncoder
from jaxserve.engine.placeholders import expand_by_kind, expand_kinds
from jaxserve.images import ImageError, pixels_digest
from jaxserve.images_internvl import InternVLImageProcessor
from jaxserve.models.vision_internvl import InternVisionConfig, encode_internvl, internvl_vision_tensors
from jaxserve.videos import FrameVideoProcessor, read_video


class InternVLImageEncoder(TileImageEncoder):
    """The vision side of an InternVL model on the device: its processor, InternViT and projector."""

    cfg: InternVisionConfig
    processor: InternVLImageProcessor
    video_processor: FrameVideoProcessor | None = None

    def __init__(self, cfg: InternVisionConfig, *args: Any, **kwargs: Any):
        super().__init__(cfg, *args, **kwargs)
        self._encode = jax.jit(functools.partial(encode_internvl, cfg=cfg))

    @functools.cached_property
    def _marks(self) -> tuple[int, int]:
        """`<img>` and `</img>`: the tokens around an image's."""
        marks = [self.tokenizer.encode(text) for text in ("<img>", "</img>")]
        if any(len(m) != 1 for m in marks):
            raise ImageError(f"InternVL's tokenizer must have <img> and </img> as tokens, it reads them as {marks}")
        return marks[0][0], marks[1][0]

    def num_tokens(self, image: PreparedImage) -> int:
        return image.pixels.shape[0] * self.cfg.tokens_per_tile

    @functools.cached_property
    def video_token_id(self) -> int | None:
        """`<video>`: where a video goes in a prompt (None: the tokenizer has no such token)."""
        ids = self.tokenizer.encode("<video>")
        return ids[0] if len(ids) == 1 else None

    def prepare_video(self, source: Any) -> PreparedVideo:
        """A video (anything `videos.load_video` reads) read, its frames sampled and made tiles."""
        if isinstance(source, PreparedVideo):
            return source
        if self.video_token_id is None:
            raise ValueError("this model takes images, not videos: its tokenizer has no <video> token")
        video = read_video(self.video_processor, source, self.allowed_local_path, self.video_frames)
        tiles, size = self.video_processor(video.frames), video.frames.shape[1:3]
        return PreparedVideo(tiles, size, pixels_digest(tiles, size), (len(tiles), 1, 1), 1.0)

    def item_layout(self, item: PreparedImage) -> list[int]:
        """The tokens an image (or a video) stands as in a prompt (see the module's docstring)."""
        start, end = self._marks
        tile = [start, *[self.cfg.image_token_id] * self.cfg.tokens_per_tile, end]
        if not isinstance(item, PreparedVideo):
            return [start, *[self.cfg.image_token_id] * self.num_tokens(item), end]
        return [t for i in range(len(item.pixels))
                for t in (*self.tokenizer.encode(f"{chr(10) if i else ''}Frame{i + 1}: "), *tile)]

    def _expand(self, ids: Sequence[int], items: Sequence[PreparedImage]) -> tuple[list[int], list, list]:
        return expand_by_kind(ids, items, lambda x: isinstance(x, PreparedVideo), self.cfg.image_token_id,
                              self.video_token_id, self.item_layout, expand_kinds)

    def layout(self, ids: Sequence[int], images: Sequence[PreparedImage]) -> tuple[list[int], list[tuple[int, int]]]:
        return self._expand(ids, images)[:2]

    def prompt(self, ids: Sequence[int], images: Sequence[Any]) -> tuple[list[int], ImagePrompt]:
        out, spans, items = self._expand(ids, [self.prepare(image) for image in images])
        takes = [np.asarray(out[first:first + n]) == self.cfg.image_token_id for first, n in spans]
        return out, ImagePrompt(spans, [cache_key(x.digest) for x in items], False, items, self._embeds, takes=takes)

    def checkpoint_tensors(self, text: Iterable[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
        """The whole model's tensors as transformers lays out InternVL's: the language model's under
        `model.language_model.` (its head as `lm_head.`), the vision side's under `model.vision_tower.` and
        `model.multi_modal_projector.`."""
        nested = ((f"model.language_model.{n.removeprefix('model.')}" if n.startswith("model.") else n, t)
                  for n, t in text)
        return itertools.chain(nested, internvl_vision_tensors(self.params, self.cfg))
