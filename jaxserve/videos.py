"""Videos in: read from what a client sends (frames as an array or a list of images, with or without their frame
rate; a data URL, an http(s) URL or a local file decoded with OpenCV), their frames chosen as transformers' video
processors choose them.

A video file is decoded with OpenCV (`pip install opencv-python-headless`, the `video` extra); frames given as
arrays need nothing. A file's frames are sampled as they are read, so a long video never sits decoded in memory.
"""

from __future__ import annotations

import abc
import math
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxserve.images import FETCH_TIMEOUT_S, ImageError, _pil, media_bytes, scaled_pixels

MAX_VIDEO_BYTES = 256 * 2**20
MAX_DECODED_FRAMES = 4096  # frames a file may keep after sampling


@dataclass(frozen=True)
class VideoRef:
    """A video content part's video as a chat template's parts hand it on (beside the images, in prompt order)."""

    source: Any


@dataclass(frozen=True)
class Video:
    """A video's frames [T, H, W, 3] (uint8 RGB), the rate they were taken at from the source (frames a second;
    None: not known), how many frames the source had, and which of them these are (None: the first T)."""

    frames: np.ndarray
    fps: float | None
    total_frames: int
    indices: np.ndarray | None = None

    @property
    def frame_indices(self) -> np.ndarray:
        """Each frame's index in the source."""
        return np.arange(len(self.frames)) if self.indices is None else self.indices

    @property
    def sampled_fps(self) -> float:
        """The rate of the frames kept, as transformers' `VideoMetadata.sampled_fps` gives it (24 when unknown)."""
        if self.fps is None:
            return 24.0
        return len(self.frames) / self.total_frames * self.fps


Sampler = Callable[[int, float | None], np.ndarray]
"""Which frames of a video to keep: (frames in the source, its frame rate or None) -> their indexes, ascending."""


def fps_sampler(fps: float, min_frames: int, max_frames: int, multiple: int) -> Sampler:
    """transformers' `sample_frames` by frame rate: `fps` frames a second, at least `min_frames` and at most
    `max_frames` (and the frames there are), rounded down to a `multiple` (the temporal patch); evenly spaced. A
    source without a frame rate keeps every frame."""
    def sample(total: int, rate: float | None) -> np.ndarray:
        if rate is None or rate <= 0:
            return np.arange(total)
        most = math.floor(min(max_frames, total) / multiple) * multiple
        n = min(max(total / rate * fps, min_frames), most, total)
        n = math.floor(n / multiple) * multiple
        if n <= 0:
            raise ImageError(f"a video of {total} frames is too short: it needs at least {multiple}")
        return np.arange(0, total, total / n).astype(np.int64)  # (torch.arange(0, total, total / n).int())
    return sample


def load_video(source: Any, allowed_local_path: str | None, sample: Sampler,
               timeout: float = FETCH_TIMEOUT_S) -> Video:
    """A video from frames ([T, H, W, 3] uint8, or a list of PIL images or [H, W, 3] arrays, kept as given), a
    (frames, metadata) pair as vLLM takes one (the metadata's `fps`: the frames' rate), a `Video`, or a file's bytes
    or URL (as `images.media_bytes` reads one; decoded with OpenCV, its frames chosen by `sample`)."""
    if isinstance(source, Video):
        return source
    if isinstance(source, tuple) and len(source) == 2 and isinstance(source[1], Mapping):
        frames = _frames(source[0])
        fps = source[1].get("fps")
        if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0):
            raise ImageError(f"a video's metadata fps must be a number > 0, got {fps!r}")
        return Video(frames, None if fps is None else float(fps), len(frames))
    if isinstance(source, (np.ndarray, list)):
        frames = _frames(source)
        return Video(frames, None, len(frames))
    data = bytes(source) if isinstance(source, (bytes, bytearray)) else \
        media_bytes(source, "video", allowed_local_path, timeout, MAX_VIDEO_BYTES)
    where = "video bytes" if not isinstance(source, str) else "the video data URL" if source.startswith("data:") \
        else source
    return decode_video(data, where, sample)


def _frames(value: Any) -> np.ndarray:
    """Frames as one uint8 array [T, H, W, 3] (grey frames made RGB; an alpha channel dropped)."""
    if isinstance(value, list):
        Image = _pil()
        if not value:
            raise ImageError("a video needs at least one frame")
        value = [np.asarray(f.convert("RGB")) if isinstance(f, Image.Image) else np.asarray(f) for f in value]
        if len({f.shape for f in value}) != 1:
            raise ImageError(f"a video's frames must all have one size, got {sorted({f.shape for f in value})}")
        value = np.stack(value)
    frames = np.asarray(value)
    if frames.ndim == 3:
        frames = np.repeat(frames[..., None], 3, axis=-1)
    if frames.ndim != 4 or frames.shape[-1] not in (3, 4) or not frames.shape[0] or 0 in frames.shape[1:3]:
        raise ImageError(f"a video's frames must be an array [frames, height, width, 3], got shape {frames.shape}")
    if frames.dtype != np.uint8:
        raise ImageError(f"a video's frames must be uint8 RGB values, got {frames.dtype}")
    return frames[..., :3]


def decode_video(data: bytes, where: str, sample: Sampler) -> Video:
    """A video file's frames chosen by `sample` (read in order, the others skipped as they are read), as RGB."""
    try:
        import cv2
    except ImportError as e:
        raise ImageError("reading video files needs OpenCV: pip install opencv-python-headless (or pass the frames "
                         "as an array)") from e
    with tempfile.NamedTemporaryFile(suffix=".video") as f:
        f.write(data)
        f.flush()
        cap = cv2.VideoCapture(f.name)
        try:
            if not cap.isOpened():
                raise ImageError(f"{where} is not a video OpenCV can read")
            total = int(cap.get(cv2.CAP_PROP_FRAME_COUNT))
            rate = float(cap.get(cv2.CAP_PROP_FPS)) or None
            if total <= 0:
                raise ImageError(f"{where} has no frames OpenCV can count")
            keep = sample(total, rate)
            if len(keep) > MAX_DECODED_FRAMES:
                raise ImageError(f"{where}: {len(keep)} frames sampled, more than {MAX_DECODED_FRAMES}")
            frames, wanted = [], set(keep.tolist())
            for i in range(int(keep[-1]) + 1 if len(keep) else 0):
                if not cap.grab():
                    break
                if i in wanted:
                    ok, frame = cap.retrieve()
                    if not ok:
                        break
                    frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
        finally:
            cap.release()
    if len(frames) != len(keep):
        raise ImageError(f"{where}: OpenCV read {len(frames)} of the {len(keep)} frames sampled (the file is cut short "
                         "or its frame count is wrong)")
    return Video(np.stack(frames), rate, total, keep)


class SamplesFiles(abc.ABC):
    """A video processor that samples a file's frames as they are read (its `sampler`) and takes frames given as they
    are unless `do_sample_frames` (its `sample_given_frames`)."""

    sample_given_frames: bool

    @abc.abstractmethod
    def sampler(self, total: int, rate: float | None) -> np.ndarray:
        """The indices of the frames kept of `total` frames at `rate` frames per second (None: unknown)."""

    def sampled(self, video: Video, given: bool) -> Video:
        """The frames kept: a file's were sampled as read; given frames as they are unless `do_sample_frames`."""
        if not given or not self.sample_given_frames:
            return video
        keep = self.sampler(len(video.frames), video.fps)
        return Video(video.frames[keep], video.fps, video.total_frames, video.frame_indices[keep])


@dataclass(frozen=True)
class FrameVideoProcessor(SamplesFiles):
    """A video processor that makes each frame one square input of the tower (InternVL's, LLaVA-OneVision's): each
    frame resized to `side` x `side` (PIL, `resample`), rescaled and normalized; a file's `num_frames` frames taken
    evenly (`middle`: each from the middle of its stretch, InternVL's `initial_shift`), given frames as they are
    unless `do_sample_frames`."""

    side: int
    resample: int
    rescale: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...]
    num_frames: int
    sample_given_frames: bool
    middle: bool

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], side: int, middle: bool,
                  mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073),
                  std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)) -> FrameVideoProcessor:
        """The processor a config describes (`side`: the tower's input, which a `size` given must be; `mean`, `std`:
        the defaults of the model's processor)."""
        d = {k: v for k, v in config.items() if v is not None}
        size = d.get("size", {"height": side, "width": side})
        if (size.get("height"), size.get("width")) != (side, side):
            raise ImageError(f"video processor size {size}: the vision tower takes {side} x {side} frames")
        n = int(d.get("num_frames", 8))
        if n < 1:
            raise ImageError(f"video processor num_frames {n}: need at least 1")
        return cls(side, int(d.get("resample", 3)),
                   float(d.get("rescale_factor", 1 / 255)) if d.get("do_rescale", True) else None,
                   tuple(d.get("image_mean", mean)) if d.get("do_normalize", True) else None,
                   tuple(d.get("image_std", std)), n, bool(d.get("do_sample_frames", False)), middle)

    def sampler(self, total: int, rate: float | None) -> np.ndarray:
        """transformers' `sample_frames` with `num_frames` (and InternVL's shift to the middle of each stretch)."""
        n = min(self.num_frames, total)
        return np.arange(total / n / 2 if self.middle else 0, total, total / n).astype(np.int64)

    def __call__(self, frames: np.ndarray) -> np.ndarray:
        """Frames [T, H, W, 3] (uint8) as the tower's inputs [T, C, side, side]."""
        Image = _pil()
        return np.stack([scaled_pixels(Image.fromarray(f), (self.side, self.side), self.resample, self.rescale,
                                       self.mean, self.std) for f in frames])


def read_video(processor: Any, source: Any, allowed_local_path: str | None, num_frames: int | None = None) -> Video:
    """A video read (`load_video`) and its frames kept as the model's video `processor` keeps them (a file's sampled
    as read, to `num_frames` when given: `--media-io-kwargs`; given frames as its `sampled` says); refused when the
    model takes no videos (`processor` None)."""
    if processor is None:
        raise ValueError("this model takes images, not videos (or its videos are turned off: limit_mm_per_prompt "
                         "video 0)")
    sampler = processor.sampler if num_frames is None else evenly(num_frames)
    return processor.sampled(load_video(source, allowed_local_path, sampler),
                             isinstance(source, (np.ndarray, list, tuple)))


def evenly(num_frames: int) -> Sampler:
    """vLLM's video loader's sampling: `num_frames` frames evenly from the first to the last (-1: every frame)."""
    def sample(total: int, rate: float | None) -> np.ndarray:
        n = total if num_frames == -1 else min(num_frames, total)
        return np.unique(np.linspace(0, total - 1, n).astype(np.int64))
    return sample
