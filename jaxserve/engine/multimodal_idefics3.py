"""Idefics3's and SmolVLM's images, and SmolVLM2's videos, in an engine's requests. The chat template writes `<image>`
where an image goes; it becomes the image's layout as transformers' processor writes it: for each tile, row by row,
`<fake_token_around_image><row_r_col_c>` and the tile's image tokens, a newline after each row (two after the last),
then `<fake_token_around_image><global-img>`, the global view's image tokens, `<fake_token_around_image>`; an image of
one tile is that last part alone. The marks are text (the prefix cache keys them as tokens); the image tokens take the
tiles' embeddings, in order. A video (`<video>`) is its frames as one-tile images, each after its time, the whole
after an introduction (`videos_idefics3`).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from jaxserve.engine.image_prompt import ImagePrompt
from jaxserve.engine.multimodal import PreparedImage, PreparedVideo, cache_key
from jaxserve.engine.multimodal_tiles import TileImageEncoder
from jaxserve.engine.placeholders import expand_by_kind, expand_kinds
from jaxserve.images import ImageError, pixels_digest
from jaxserve.images_idefics3 import Idefics3ImageProcessor
from jaxserve.models.vision import vision_tensors
from jaxserve.videos import read_video
from jaxserve.videos_idefics3 import SmolVLMVideoProcessor, video_intro


class Idefics3ImageEncoder(TileImageEncoder):
    """The vision side of an Idefics3 or SmolVLM model: its SigLIP tower and connector."""

    processor: Idefics3ImageProcessor
    video_processor: SmolVLMVideoProcessor | None = None  # SmolVLM2's (None: images only)

    def take_videos(self, processor: SmolVLMVideoProcessor) -> None:
        """Serve videos with `processor`; `<video>` (which transformers' processor finds in the text) becomes a token
        of the tokenizer where it is not one, so that a chat template's `<video>` is one placeholder."""
        if self.tokenizer is None:  # (`skip_tokenizer_init`: a video's placeholder would be unknown; images only)
            return
        self.video_processor = processor
        if self.tokenizer.token_to_id("<video>") is None:
            import tokenizers

            self.tokenizer.backend.add_special_tokens([tokenizers.AddedToken("<video>", special=True)])
        self.video_token_id = self.tokenizer.encode("<video>")[0]
        self.placeholder_ids = (self.video_token_id,)

    @functools.lru_cache(maxsize=256)  # noqa: B019 - the encoder lives as long as its engine
    def _mark(self, text: str) -> int:
        ids = self.tokenizer.encode(text)
        if len(ids) != 1:
            raise ImageError(f"the tokenizer must have {text} as a token for Idefics3's image layout, it reads {ids}")
        return ids[0]

    def image_layout(self, image: PreparedImage) -> list[int]:
        """The tokens an image stands as in a prompt (see the module's docstring); a video's, its frames' and text."""
        if isinstance(image, PreparedVideo):
            intro, *times = image.texts
            parts = [self.tokenizer.encode(intro), *([*self.tokenizer.encode(at), *self._single()] for at in times)]
            return [t for part in (*parts, self.tokenizer.encode("\n\n")) for t in part]
        rows, cols = self.processor.grid(image.size)
        fake, seq = self._mark("<fake_token_around_image>"), [self.cfg.image_token_id] * self.cfg.tokens_per_image
        out: list[int] = []
        for r in range(rows):
            for c in range(cols):
                out += [fake, self._mark(f"<row_{r + 1}_col_{c + 1}>"), *seq]
            out += self.tokenizer.encode("\n" if r < rows - 1 else "\n\n")
        return out + self._single()

    def _single(self) -> list[int]:
        """The layout of one tile's global view (a one-tile image's whole layout)."""
        fake = self._mark("<fake_token_around_image>")
        return [fake, self._mark("<global-img>"), *[self.cfg.image_token_id] * self.cfg.tokens_per_image, fake]

    def num_tokens(self, image: PreparedImage) -> int:
        return len(self.image_layout(image))

    def prepare_video(self, source: Any) -> PreparedVideo:
        """A video (anything `videos.load_video` reads) read, its frames sampled and made one-tile images."""
        if isinstance(source, PreparedVideo):
            return source
        video = read_video(self.video_processor, source, self.allowed_local_path, self.video_frames)
        tiles, size = self.video_processor(video.frames), video.frames.shape[1:3]
        intro, times = video_intro(video)
        return PreparedVideo(tiles, size, pixels_digest(tiles, size), (len(tiles), 1, 1), 1.0, texts=(intro, *times))

    def _expand(self, ids: Sequence[int], items: Sequence[PreparedImage]) -> tuple[list[int], list, list]:
        return expand_by_kind(ids, items, lambda x: isinstance(x, PreparedVideo), self.cfg.image_token_id,
                              getattr(self, "video_token_id", None), self.image_layout, expand_kinds)

    def layout(self, ids: Sequence[int], images: Sequence[PreparedImage]) -> tuple[list[int], list[tuple[int, int]]]:
        return self._expand(ids, images)[:2]

    def prompt(self, ids: Sequence[int], images: Sequence[Any]) -> tuple[list[int], ImagePrompt]:
        out, spans, items = self._expand(ids, [self.prepare(image) for image in images])
        takes = [np.asarray(out[first:first + n]) == self.cfg.image_token_id for first, n in spans]
        return out, ImagePrompt(spans, [cache_key(x.digest) for x in items], False, items, self._embeds, takes=takes)

    def checkpoint_tensors(self, text: Iterable[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
        """The whole model's tensors as transformers lays out Idefics3's and SmolVLM's: the language model's under
        `model.text_model.` (its head as `lm_head.`), the tower's under `model.vision_model.`, the connector's under
        `model.connector.`."""
        nested = ((f"model.text_model.{n.removeprefix('model.')}" if n.startswith("model.") else n, t)
                  for n, t in text)
        return itertools.chain(nested, vision_tensors(self.params, self.cfg))
