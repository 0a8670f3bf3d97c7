"""Qwen2-VL's and Qwen2.5-VL's video processor (transformers' `Qwen2VLVideoProcessor`) step for step: frames sampled
by rate (`videos.fps_sampler`: a file's always, given frames when `do_sample_frames` says so), each frame resized to
one size for the whole video (`smart_resize` within the video's own `min_pixels` and `max_pixels`, optionally each
frame's share of a budget for the whole video), rescaled and normalized as an image is (`QwenImageProcessor`), the
last frame repeated up to a whole temporal patch, and cut into patches [t * h * w, C * T * P * P]: temporal patch by
temporal patch, each as an image's (merge groups row by row), a patch's values over (channel, frame, row, column).

Frames are resized with PIL's filter (as the image processor's PIL version resizes), where transformers' video
processor resizes with torchvision's: the pixels differ a little.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from jaxserve.images import ImageError, _pil, scaled_pixels
from jaxserve.images_qwen2 import QwenImageProcessor, smart_resize
from jaxserve.videos import Sampler, Video, fps_sampler

VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS = 128 * 28 * 28, 28 * 28 * 768  # transformers' defaults for a video's frames
_KINDS = ("Qwen2VLVideoProcessor",)


@dataclass(frozen=True)
class QwenVideoProcessor:
    """A Qwen2-VL / Qwen2.5-VL video processor's settings (`video_preprocessor_config.json`, else the image
    processor's file, as transformers falls back to it)."""

    frame: QwenImageProcessor  # each frame's resize bounds, filter, rescale and normalization
    fps: float  # frames a second kept of a video
    min_frames: int
    max_frames: int
    sample_given_frames: bool  # `do_sample_frames`: frames given with their rate are sampled too
    cap_pixels_per_frame: bool  # each frame within its share of `max_video_tokens` tokens' pixels (qwen-vl-utils')
    max_video_tokens: int

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> QwenVideoProcessor:
        """The processor a config describes; what it leaves out is transformers' default for a video."""
        d = {k: v for k, v in config.items() if v is not None}
        kind = str(d.pop("video_processor_type", "Qwen2VLVideoProcessor")).removesuffix("Fast")
        if kind not in _KINDS:
            raise ImageError(f"video processor {kind!r} is not Qwen2-VL's (supported: {', '.join(_KINDS)})")
        size = dict(d.get("size", {}))
        size.setdefault("shortest_edge", VIDEO_MIN_PIXELS)
        size.setdefault("longest_edge", VIDEO_MAX_PIXELS)
        frame = QwenImageProcessor.from_dict({**{k: v for k, v in d.items() if k != "image_processor_type"},
                                              "size": size})
        fps, least, most = float(d.get("fps", 2.0)), int(d.get("min_frames", 4)), int(d.get("max_frames", 768))
        if not (fps > 0 and 0 < least <= most):
            raise ImageError(f"Qwen2-VL video processor fps {fps}, min_frames {least}, max_frames {most}: need fps > 0 "
                             "and 0 < min_frames <= max_frames")
        return cls(frame, fps, least, most, bool(d.get("do_sample_frames", False)),
                   bool(d.get("cap_pixels_per_frame", False)), int(d.get("max_video_tokens", 128000)))

    @property
    def sampler(self) -> Sampler:
        return fps_sampler(self.fps, self.min_frames, self.max_frames, self.frame.temporal_patch_size)

    def sampled(self, video: Video, given: bool) -> Video:
        """The frames kept of a video: a file's were sampled as it was read; `given` frames (an array) as they are,
        unless `do_sample_frames` (and their rate is known)."""
        if not given or not self.sample_given_frames or video.fps is None:
            return video
        keep = self.sampler(len(video.frames), video.fps)
        return replace(video, frames=video.frames[keep])

    def resized_size(self, video: Video) -> tuple[int, int]:
        """The (height, width) every frame of `video` is resized to."""
        f = self.frame
        _, height, width, _ = video.frames.shape
        if not f.resize:
            return f.resized_size((height, width))
        most = f.max_pixels
        if self.cap_pixels_per_frame:
            budget = int(self.max_video_tokens * f.factor * f.factor * 0.9)
            most = max(min(most, budget * f.temporal_patch_size // len(video.frames)), int(f.min_pixels * 1.05))
        return smart_resize(height, width, f.factor, f.min_pixels, most)

    def __call__(self, video: Video) -> tuple[np.ndarray, tuple[int, int, int]]:
        """A video's patches [t * h * w, C * T * P * P] (see the module's docstring for the order) and its patch
        grid (t, h, w)."""
        f = self.frame
        size, Image = self.resized_size(video), _pil()
        pixels = np.stack([scaled_pixels(Image.fromarray(frame), size, f.resample, f.rescale, f.mean, f.std)
                           for frame in video.frames])  # [frames, C, H, W]
        T, P, m = f.temporal_patch_size, f.patch_size, f.merge_size
        if pad := -len(pixels) % T:
            pixels = np.concatenate([pixels, np.repeat(pixels[-1:], pad, axis=0)])
        n, C, H, W = pixels.shape
        t, h, w = n // T, H // P, W // P
        patches = pixels.reshape(t, T, C, h // m, m, P, w // m, m, P).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return np.ascontiguousarray(patches).reshape(t * h * w, C * T * P * P), (t, h, w)


def video_processor_config(path: str, kwargs: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """A model directory's video processor settings as transformers finds them (`processor_config.json`'s
    `video_processor`, else `video_preprocessor_config.json`, else the image processor's `preprocessor_config.json`)
    with `--mm-processor-kwargs` over them; None when there is none."""
    import json

    for name, key in (("processor_config.json", "video_processor"), ("video_preprocessor_config.json", None),
                      ("preprocessor_config.json", None)):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            with open(file) as fh:
                d = json.load(fh)
            d = d.get(key) if key else d
            if d:
                return {**d, **(kwargs or {})}
    return None
