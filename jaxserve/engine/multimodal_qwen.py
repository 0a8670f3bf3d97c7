"""Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's images in an engine's requests (and EXAONE 4.5's: Qwen2.5-VL's tower, its
language model turning each token by its position alone, the grids below unused).

An image takes as many `<|image_pad|>` tokens as its resized size has merged patches (the processor keeps it
between `min_pixels` and `max_pixels`), so its tokens depend on its size, as LLaVA-NeXT's do. Its tokens turn by
their place in it (M-RoPE: temporal, row, column), and the text after it by the positions they did not take: the
prompt keeps each image's token grid (`ImagePrompt.grids`) for the steps' rotary offsets. A chat template writes
`<|vision_start|><|image_pad|><|vision_end|>` where an image goes; the one `<|image_pad|>` becomes the image's.

A video (Qwen2-VL, Qwen2.5-VL) is its temporal patches' tokens in one `<|video_pad|>` run, patch after patch, each
patch's as an image's; its tokens turn by (temporal patch, row, column), the temporal index moving by the video's
`time_step` from one patch to the next (Qwen2.5-VL: `tokens_per_second` a second; Qwen2-VL: 1), and the text after
it goes on from its largest position (the original Qwen rule, and vLLM's). Its frames attend within their temporal
patch in the tower. The i-th video fills the prompt's i-th `<|video_pad|>`, as the i-th image fills the i-th
`<|image_pad|>`.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from jaxserve.engine.image_prompt import ImagePrompt
from jaxserve.engine.multimodal import ImageEncoder, PreparedImage, PreparedVideo, cache_key
from jaxserve.engine.placeholders import expand_by_kind, expand_media
from jaxserve.engine.video_qwen3 import frames_of, timestamped
from jaxserve.images import checked_patches, pixels_digest
from jaxserve.images_qwen2 import QwenImageProcessor
from jaxserve.models.vision_qwen2 import (
    QwenVisionConfig,
    qwen_encode,
    qwen_token_grid,
    qwen_tokens,
    qwen_vision_tensors,
)
from jaxserve.videos import read_video
from jaxserve.videos_qwen2 import QwenVideoProcessor

VIDEO_TOKEN_ID = 151656  # Qwen2-VL's `<|video_pad|>`


class QwenImageEncoder(ImageEncoder):
    """The vision side of a Qwen2-VL, Qwen2.5-VL or Qwen3-VL model on the device: its processor, tower and merger
    (and Qwen3-VL's deepstack mergers); Qwen2-VL's and Qwen2.5-VL's take videos too (`video_processor`)."""

    cfg: QwenVisionConfig
    processor: QwenImageProcessor
    video_processor: QwenVideoProcessor | None = None

    def warmup(self) -> float:
        """Compile the tower for the smallest image the processor makes (its bucket of patches); images in larger
        buckets compile as they first come."""
        t0 = time.perf_counter()
        side = self.processor.factor
        grid = self.processor.grid((side, side))
        qwen_encode(self.params, self.cfg, np.zeros((int(np.prod(grid)), self.cfg.patch_dim), np.float32), grid)
        return time.perf_counter() - t0

    @property
    def video_token_id(self) -> int:
        """`<|video_pad|>`: a video's placeholder in a prompt, one per merged patch of each temporal patch."""
        return int(self.hf_config.get("video_token_id", VIDEO_TOKEN_ID))

    def views(self, image: PreparedImage) -> list[PreparedImage]:
        """What the decoder sees of an image or video: itself; a Qwen3-VL video's temporal patches, one by one."""
        qwen3_video = self.cfg.variant == "qwen3_vl" and isinstance(image, PreparedVideo)
        return frames_of(image) if qwen3_video else [image]

    def _grid(self, image: PreparedImage) -> tuple[int, int, int]:
        return image.grid if isinstance(image, PreparedVideo) else self.processor.grid(image.size)

    def num_tokens(self, image: PreparedImage) -> int:
        return qwen_tokens(self._grid(image), self.cfg)

    def pixels(self, image: Any) -> np.ndarray:
        """One image (read) as the tower's flattened patches [t * h * w, C * T * P * P]."""
        return checked_patches(self.processor(image), self.cfg.patch_dim)

    def prepare_video(self, source: Any) -> PreparedVideo:
        """A video (anything `videos.load_video` reads) read, its frames sampled and processed."""
        if isinstance(source, PreparedVideo):
            return source
        vp = self.video_processor
        video = read_video(vp, source, self.allowed_local_path, self.video_frames)
        patches, grid = vp(video)
        # Qwen2.5-VL: a temporal patch lasts temporal_patch_size frames; its position moves tokens_per_second a second.
        per_second = self.hf_config.get("vision_config", {}).get("tokens_per_second")
        step = 1.0 if per_second is None or vp.qwen3 else \
            per_second * vp.frame.temporal_patch_size / video.sampled_fps
        times = tuple(vp.timestamps(video)) if vp.qwen3 else ()
        size = video.frames.shape[1:3]
        digest = hashlib.sha256(pixels_digest(patches, size) + np.float64(step).tobytes() + repr(times).encode())
        return PreparedVideo(patches, size, digest.digest(), grid, step, times)

    def layout(self, ids: Sequence[int], images: Sequence[PreparedImage]) -> tuple[list[int], list[tuple[int, int]]]:
        return self._expand(ids, images)[:2]

    def _expand(self, ids: Sequence[int], items: Sequence[PreparedImage]) -> tuple[list[int], list, list]:
        """The prompt expanded, each item's span and the items in prompt order: the i-th image at the i-th image
        placeholder, the i-th video at the i-th video placeholder (Qwen3-VL's: its temporal patches, each after its
        time, `video_qwen3`)."""
        if self.cfg.variant == "qwen3_vl" and any(isinstance(x, PreparedVideo) for x in items):
            videos = [x for x in items if isinstance(x, PreparedVideo)]
            ids = timestamped(ids, videos, [qwen_tokens((1, *x.grid[1:]), self.cfg) for x in videos],
                              lambda at: self.tokenizer.encode(f"<{at:.1f} seconds>"), self.cfg.vision_start_token_id,
                              self.cfg.vision_end_token_id, self.video_token_id)
            items = [y for x in items for y in self.views(x)]
        return expand_by_kind(ids, items, lambda x: isinstance(x, PreparedVideo), self.cfg.image_token_id,
                              self.video_token_id, self.num_tokens, expand_media)

    def prompt(self, ids: Sequence[int], images: Sequence[Any]) -> tuple[list[int], ImagePrompt]:
        out, spans, items = self._expand(ids, [self.prepare(image) for image in images])
        steps = [x.time_step if isinstance(x, PreparedVideo) else 1.0 for x in items]
        return out, ImagePrompt(spans, [cache_key(x.digest) for x in items], False, items, self._embeds,
                                grids=[qwen_token_grid(self._grid(x), self.cfg) for x in items], time_steps=steps)

    def _encode_pixels(self, image: PreparedImage) -> np.ndarray:
        return qwen_encode(self.params, self.cfg, image.pixels, self._grid(image))

    def checkpoint_tensors(self, text: Iterable[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
        """The whole model's tensors as the Hub lays out Qwen2-VL's (the language model's names as they are, the
        vision side's under `visual.`) or Qwen3-VL's and EXAONE 4.5's (the language model's under
        `model.language_model.`, the vision side's under `model.visual.`)."""
        if self.cfg.nested:
            nested = ((f"model.language_model.{n.removeprefix('model.')}" if n.startswith("model.") else n, t)
                      for n, t in text)
            return itertools.chain(nested, qwen_vision_tensors(self.params, self.cfg, prefix="model.visual."))
        return itertools.chain(text, qwen_vision_tensors(self.params, self.cfg, prefix="visual."))

