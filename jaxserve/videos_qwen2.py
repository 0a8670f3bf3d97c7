"""Qwen2-VL's and Qwen2.5-VL's video processor (transformers' `Qwen2VLVideoProcessor`) step for step: frames sampled
by rate (`videos.fps_sampler`: a file's always, given frames when `do_sample_frames` says so), each frame resized to
one size for the whole video (`smart_resize` within the video's own `min_pixels` and `max_pixels`, optionally each
frame's share of a budget for the whole video), rescaled and normalized as an image is (`QwenImageProcessor`), the
last frame repeated up to a whole temporal patch, and cut into patches [t * h * w, C * T * P * P]: temporal patch by
temporal patch, each as an image's (merge groups row by row), a patch's values over (channel, frame, row, column).

Qwen3-VL's (`Qwen3VLVideoProcessor`) differs in its defaults (16-pixel patches, mean and std 0.5, `size` only), in
its sampling (`num_frames` evenly over the whole video by `np.linspace`, given frames too unless `do_sample_frames` is
off, 24 frames a second assumed when the rate is not known), in its bounds (on all the frames' pixels together, not
each frame's), and gives each temporal patch its time (`timestamps`), which its prompt writes before the patch.

Frames are resized with PIL's filter (as the image processor's PIL version resizes), where transformers' video
processor resizes with torchvision's: the pixels differ a little.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from jaxserve.images import ImageError, _pil, first_settings, scaled_pixels
from jaxserve.images_qwen2 import QwenImageProcessor, smart_resize
from jaxserve.videos import Sampler, Video, fps_sampler

VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS = 128 * 28 * 28, 28 * 28 * 768  # transformers' defaults for a video's frames
QWEN3_DEFAULTS = {"size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}, "patch_size": 16,
                  "image_mean": (0.5, 0.5, 0.5), "image_std": (0.5, 0.5, 0.5), "do_sample_frames": True,
                  "max_video_tokens": 768}
_KINDS = ("Qwen2VLVideoProcessor", "Qwen3VLVideoProcessor")


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
    qwen3: bool = False  # Qwen3-VL's processor (see the module's docstring)

    @classmethod
    def from_dict(cls, config: dict[str, Any], qwen3: bool = False) -> QwenVideoProcessor:
        """The processor a config describes (`qwen3`: Qwen3-VL's, whatever the config names); what it leaves out is
        transformers' default for a video."""
        d = {k: v for k, v in config.items() if v is not None}
        kind = str(d.pop("video_processor_type", "Qwen2VLVideoProcessor")).removesuffix("Fast")
        if kind not in _KINDS:
            raise ImageError(f"video processor {kind!r} is not Qwen2-VL's (supported: {', '.join(_KINDS)})")
        qwen3 = qwen3 or kind == "Qwen3VLVideoProcessor"
        if qwen3:  # (its bounds are `size`'s alone)
            d = {**QWEN3_DEFAULTS, **{k: v for k, v in d.items() if k not in ("min_pixels", "max_pixels")}}
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
                   bool(d.get("cap_pixels_per_frame", False)), int(d.get("max_video_tokens", 128000)), qwen3)

    @property
    def sampler(self) -> Sampler:
        if self.qwen3:
            return self._qwen3_sample
        return fps_sampler(self.fps, self.min_frames, self.max_frames, self.frame.temporal_patch_size)

    def _qwen3_sample(self, total: int, rate: float | None) -> np.ndarray:
        """Qwen3-VL's `sample_frames`: `fps` frames a second (24 a second assumed for the source when not known), at
        least `min_frames` and at most `max_frames` (and the frames there are), evenly over the whole video."""
        n = min(max(int(total / (rate or 24) * self.fps), self.min_frames), self.max_frames, total)
        return np.linspace(0, total - 1, n).round().astype(np.int64)

    def sampled(self, video: Video, given: bool) -> Video:
        """The frames kept of a video: a file's were sampled as it was read; `given` frames (an array) as they are,
        unless `do_sample_frames` (Qwen2-VL's: and their rate is known)."""
        if not given or not self.sample_given_frames or (video.fps is None and not self.qwen3):
            return video
        keep = self.sampler(len(video.frames), video.fps)
        return replace(video, frames=video.frames[keep], indices=video.frame_indices[keep])

    def timestamps(self, video: Video) -> list[float]:
        """Qwen3-VL: each temporal patch's time in seconds, the mean of its first and last frames' (the last frame
        repeated as in the patches), at the source's rate (24 a second when not known)."""
        T, rate = self.frame.temporal_patch_size, video.fps or 24
        at = video.frame_indices.tolist()
        at += at[-1:] * (-len(at) % T)
        return [(at[i] / rate + at[i + T - 1] / rate) / 2 for i in range(0, len(at), T)]

    def resized_size(self, video: Video) -> tuple[int, int]:
        """The (height, width) every frame of `video` is resized to."""
        f = self.frame
        n, height, width, _ = video.frames.shape
        if not f.resize:
            return f.resized_size((height, width))
        if self.qwen3:
            return self._qwen3_size(n, height, width)
        most = f.max_pixels
        if self.cap_pixels_per_frame:
            budget = int(self.max_video_tokens * f.factor * f.factor * 0.9)
            most = max(min(most, budget * f.temporal_patch_size // len(video.frames)), int(f.min_pixels * 1.05))
        return smart_resize(height, width, f.factor, f.min_pixels, most)

    def _qwen3_size(self, n: int, height: int, width: int) -> tuple[int, int]:
        """Qwen3-VL's `smart_resize`: sides to multiples of the merged patch, all `n` frames' pixels together held
        within `size`'s bounds (optionally each frame within `max_video_tokens` tokens' pixels)."""
        f, T = self.frame, self.frame.temporal_patch_size
        factor, least, most = f.factor, f.min_pixels, f.max_pixels
        if n < T:
            raise ImageError(f"a video of {n} frame(s): Qwen3-VL's processor takes at least {T}")
        if self.cap_pixels_per_frame:
            per_frame = max(min(self.max_video_tokens * factor * factor, most // n), int(least * 1.05))
            most = per_frame * n
        if height < factor or width < factor:
            scale = max(factor / height, factor / width)
            height, width = int(height * scale), int(width * scale)
        if max(height, width) / min(height, width) > 200:
            raise ImageError(f"a video of {height} x {width} pixels is too long: aspect ratios up to 200 are taken")
        h, w, t = round(height / factor) * factor, round(width / factor) * factor, round(n / T) * T
        if t * h * w > most:
            beta = math.sqrt(n * height * width / most)
            h = max(factor, math.floor(height / beta / factor) * factor)
            w = max(factor, math.floor(width / beta / factor) * factor)
        elif t * h * w < least:
            beta = math.sqrt(least / (n * height * width))
            h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
        return h, w

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
    found = first_settings(path, (("processor_config.json", "video_processor"), ("video_preprocessor_config.json", None),
                                  ("preprocessor_config.json", None)))
    return None if found is None else {**found, **(kwargs or {})}
