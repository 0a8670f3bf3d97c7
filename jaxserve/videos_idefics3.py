"""SmolVLM2's videos (transformers' `SmolVLMVideoProcessor` and `SmolVLMProcessor.replace_video_token`, step for step).

Frames: a file's sampled as transformers' `sample_frames` does (about `fps` a second, at most `max_frames`, evenly
between its first and last frame, a second skipped at each end when the video is long enough); given frames as they
are unless `do_sample_frames`. Each frame is resized (PIL, Lanczos) so its longest side is `video_size`, then to one
square tile of the tower's side, rescaled and normalized: one input of the tower, written as a single image is.

Text: `<video>` becomes "You are provided the following series of {frames, in words} frames from a {H:MM:SS} [H:MM:SS]
video.\\n", then for each frame "\\nFrame from {MM:SS}:" and the frame's image tokens
(`<fake_token_around_image><global-img>` ... `<fake_token_around_image>`), then "\\n\\n". A frame's time is its index
over the video's frame rate (24 when the rate is not known, as transformers assumes); the duration, its frame count
over that rate.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np

from jaxserve.images import ImageError, _pil, scaled_pixels
from jaxserve.images_idefics3 import longest_to
from jaxserve.videos import SamplesFiles, Video

ASSUMED_FPS = 24.0  # transformers' frame rate for frames given without theirs
_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
         "seventeen eighteen nineteen").split()
_TENS = "twenty thirty forty fifty sixty seventy eighty ninety".split()


def number_words(n: int) -> str:
    """`n` (0 <= n < 1,000,000) in English words as `num2words` writes them ("twenty-one", "one hundred and five",
    "two thousand and three")."""
    if not 0 <= n < 1_000_000:
        raise ValueError(f"{n} is out of the range written in words (0 to 999,999)")
    if n < 20:
        return _ONES[n]
    if n < 100:
        return _TENS[n // 10 - 2] + ("" if n % 10 == 0 else "-" + _ONES[n % 10])
    if n < 1000:
        rest = n % 100
        return f"{_ONES[n // 100]} hundred" + ("" if rest == 0 else " and " + number_words(rest))
    rest = n % 1000
    head = f"{number_words(n // 1000)} thousand"
    if rest == 0:
        return head
    return head + (" and " if rest < 100 else ", ") + number_words(rest)


@dataclass(frozen=True)
class SmolVLMVideoProcessor(SamplesFiles):
    """SmolVLM2's video settings (`preprocessor_config.json`'s `video_sampling`, or a video processor's own)."""

    tile: int  # the tower's side: each frame's final square
    longest: int | None  # `video_size["longest_edge"]`: each frame's first resize
    fps: float
    max_frames: int
    resample: int
    rescale: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...]
    sample_given_frames: bool

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], tile: int) -> SmolVLMVideoProcessor:
        """The processor the settings describe (`tile`: the tower's input side, which `max_image_size` must be)."""
        d = {k: v for k, v in config.items() if v is not None}
        sampling = dict(d.get("video_sampling") or {})
        most = dict(d.get("max_image_size", {"longest_edge": tile})).get("longest_edge")
        if most != tile:
            raise ImageError(f"video processor max_image_size {d.get('max_image_size')}: the vision tower takes "
                             f"{tile} x {tile} frames")
        size = dict(sampling.get("video_size") or d.get("size") or {"longest_edge": 4 * 364})
        if "longest_edge" not in size:
            raise ImageError(f"video processor size {size}: only longest_edge is supported")
        fps = float(d.get("fps", sampling.get("fps", 1)))
        n = int(d.get("num_frames", d.get("max_frames", sampling.get("max_frames", 64))))
        if fps <= 0 or n < 1:
            raise ImageError(f"video processor fps {fps} and max_frames {n}: both must be positive")
        return cls(tile, int(size["longest_edge"]) if d.get("do_resize", True) else None, fps, n,
                   int(d.get("resample", 1)),
                   float(d.get("rescale_factor", 1 / 255)) if d.get("do_rescale", True) else None,
                   tuple(d.get("image_mean", (0.5, 0.5, 0.5))) if d.get("do_normalize", True) else None,
                   tuple(d.get("image_std", (0.5, 0.5, 0.5))), bool(d.get("do_sample_frames", False)))

    def sampler(self, total: int, rate: float | None) -> np.ndarray:
        """transformers' `sample_frames` (`skip_secs` 1) over a video of `total` frames at `rate` a second."""
        rate = rate or ASSUMED_FPS
        duration = total / rate
        wanted = max(1, min(int(round(self.fps * duration)), self.max_frames))
        start, end = 0, total - 1
        if duration - 2 > self.max_frames * self.fps:
            start, end = int(rate), int(total - rate)
        start, end = max(0, start), min(end, total - 1)
        if start >= end:
            start, end = 0, total - 1
        return np.unique(np.linspace(start, end, wanted, dtype=int))

    def __call__(self, frames: np.ndarray) -> np.ndarray:
        """Frames [T, H, W, 3] (uint8) as the tower's inputs [T, C, tile, tile]."""
        Image, out = _pil(), []
        for frame in frames:
            image = Image.fromarray(frame)
            if self.longest:
                h, w = longest_to(image.height, image.width, self.longest)
                if (h, w) != (image.height, image.width):
                    image = image.resize((w, h), resample=Image.Resampling(self.resample))
            out.append(scaled_pixels(image, (self.tile, self.tile), self.resample, self.rescale, self.mean, self.std))
        return np.stack(out)


def video_intro(video: Video) -> tuple[str, list[str]]:
    """The text before a video's frames and each frame's time as written before it ("\\nFrame from MM:SS:")."""
    rate = video.fps or ASSUMED_FPS
    seconds = [i / rate for i in video.frame_indices]
    duration = timedelta(seconds=int(video.total_frames / rate))
    intro = (f"You are provided the following series of {number_words(len(seconds))} frames from a {duration} "
             "[H:MM:SS] video.\n")
    return intro, [f"\nFrame from {int(s // 60):02d}:{int(s % 60):02d}:" for s in seconds]
