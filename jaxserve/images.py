"""Images in: read from what a client sends (a data URL, an http(s) URL, a local file, bytes or a PIL image) and
turned into the pixel arrays a vision tower takes, the way the model's HF image processor makes them.

The processing follows transformers' PIL image processors (CLIP's, SigLIP's and Gemma 3's), step for step: RGB
(transparency over white), a resize with the processor's resampling filter (the shortest edge to a length, or to a
fixed size), a center crop, a rescale to [0, 1] and a per-channel normalization.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import math
import os
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxserve.models.vision import NEXT_PINPOINTS, ONEVISION_PINPOINTS

MAX_IMAGE_BYTES = 20 * 2**20
FETCH_TIMEOUT_S = 10.0
_SUPPORTED = ("CLIPImageProcessor", "SiglipImageProcessor", "LlavaNextImageProcessor", "LlavaOnevisionImageProcessor",
              "Gemma3ImageProcessor")
_SQUARE = ("SiglipImageProcessor", "Gemma3ImageProcessor")  # a fixed size, no crop, mean and std 0.5


class ImageError(ValueError):
    """An image could not be read, or is not allowed from where it was asked for."""


def _pil():
    try:
        from PIL import Image
    except ImportError as e:  # pragma: no cover - Pillow is a dependency
        raise ImageError("reading images needs Pillow (pip install pillow)") from e
    return Image


def load_image(source: Any, allowed_local_path: str | None = None, timeout: float = FETCH_TIMEOUT_S):
    """A PIL image from a PIL image, bytes, a `data:image/...;base64,` URL, an http(s) URL, or a local file
    (`file://` URL or path; only under `allowed_local_path`, as vLLM's `--allowed-local-media-path`)."""
    Image = _pil()
    if isinstance(source, Image.Image):
        return source
    if isinstance(source, (bytes, bytearray)):
        return _open(bytes(source), "image bytes")
    data = media_bytes(source, "image", allowed_local_path, timeout, MAX_IMAGE_BYTES)
    return _open(data, "the image data URL" if source.startswith("data:") else source)


def media_bytes(source: Any, kind: str, allowed_local_path: str | None, timeout: float, limit: int) -> bytes:
    """The bytes of an image or a video (`kind`) a URL names: a `data:<kind>/...;base64,` URL, an http(s) URL, or a
    local file (`file://` URL or path) under `allowed_local_path`; at most `limit` bytes."""
    if not isinstance(source, str):
        raise ImageError(f"an {kind} must be a URL, a path, bytes or a{'' if kind == 'video' else ' PIL'} {kind}, "
                         f"got {type(source).__name__}")
    if source.startswith("data:"):
        header, sep, payload = source.partition(",")
        if not sep or not header.endswith(";base64") or not header[5:].startswith(f"{kind}/"):
            raise ImageError(f"an {kind} data URL must read data:{kind}/<type>;base64,<data>")
        try:
            return _capped(base64.b64decode(payload, validate=True), f"the {kind} data URL", kind, limit)
        except (binascii.Error, ValueError) as e:
            raise ImageError(f"the {kind} data URL is not valid base64: {e}") from e
    scheme = urllib.parse.urlparse(source).scheme
    if scheme in ("http", "https"):
        try:
            with urllib.request.urlopen(urllib.request.Request(source, headers={"User-Agent": "jaxserve"}),
                                        timeout=timeout) as r:
                return _capped(r.read(limit + 1), source, kind, limit)
        except (OSError, ValueError) as e:
            raise ImageError(f"cannot fetch {kind} {source}: {e}") from e
    path = urllib.parse.unquote(urllib.parse.urlparse(source).path) if scheme == "file" else source
    if scheme not in ("", "file"):
        raise ImageError(f"{kind} URL scheme {scheme!r} is not supported (data:, http(s):, file:)")
    if allowed_local_path is None:
        raise ImageError(f"local {kind} {source!r} refused: local files are read only under the directory given by "
                         "--allowed-local-media-path")
    real, root = os.path.realpath(path), os.path.realpath(allowed_local_path)
    if os.path.commonpath([real, root]) != root:
        raise ImageError(f"local {kind} {source!r} is outside the allowed directory {allowed_local_path!r}")
    try:
        with open(real, "rb") as f:
            return _capped(f.read(limit + 1), source, kind, limit)
    except OSError as e:
        raise ImageError(f"cannot read {kind} {source!r}: {e.strerror}") from e


def _capped(data: bytes, where: str, kind: str, limit: int) -> bytes:
    if len(data) > limit:
        raise ImageError(f"{kind} {where} is larger than {limit // 2**20} MiB")
    return data


def _open(data: bytes, where: str):
    Image = _pil()
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except Exception as e:  # noqa: BLE001 - Pillow raises many kinds for a bad file
        raise ImageError(f"{where} is not an image Pillow can read: {e}") from e
    return image


def _rgb(image):
    """RGB pixels as transformers makes them: transparency composited over white."""
    Image = _pil()
    if image.mode == "RGB":
        return image
    rgba = image.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


@dataclass(frozen=True)
class PanAndScan:
    """Gemma 3's pan and scan: an image whose sides differ by `min_ratio` or more is also cut along its long side
    into 2 to `max_crops` equal crops (about as many as the ratio) of at least `min_crop` pixels a side, each then
    processed as an image of its own."""

    min_crop: int
    max_crops: int
    min_ratio: float

    def __post_init__(self) -> None:
        if self.min_crop < 1 or self.max_crops < 2 or self.min_ratio < 1:
            raise ImageError(f"pan and scan needs pan_and_scan_min_crop_size >= 1 (got {self.min_crop}), "
                             f"pan_and_scan_max_num_crops >= 2 (got {self.max_crops}) and "
                             f"pan_and_scan_min_ratio_to_activate >= 1 (got {self.min_ratio})")

    def boxes(self, width: int, height: int) -> list[tuple[int, int, int, int]]:
        """The crops' (left, top, right, bottom), row by row, as transformers cuts them (none: the image alone)."""
        long, short = max(width, height), min(width, height)
        if long / short < self.min_ratio:
            return []
        n = min(self.max_crops, max(2, min(int(math.floor(long / short + 0.5)), long // self.min_crop)))
        across, down = (n, 1) if width >= height else (1, n)
        w, h = -(-width // across), -(-height // down)
        if min(w, h) < self.min_crop:
            return []
        # The last crop stops at the image's edge (a slice, not padding).
        return [(x, y, min(x + w, width), min(y + h, height))
                for y in range(0, h * down, h) for x in range(0, w * across, w)]


@dataclass(frozen=True)
class ImageProcessor:
    """A CLIP, SigLIP, LLaVA-NeXT or Gemma 3 image processor's settings (`preprocessor_config.json`)."""

    resize: tuple[str, int, int] | None  # ("shortest_edge", n, 0) or ("fixed", height, width)
    resample: int
    crop: tuple[int, int] | None
    rescale: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None
    convert_rgb: bool
    grid_pinpoints: tuple[tuple[int, int], ...] | None = None
    """LLaVA-NeXT's resolutions (height, width): an image is also cut into crops at the one that fits it best."""
    pan_and_scan: PanAndScan | None = None  # Gemma 3's crops of a long image, each also an image
    source: dict[str, Any] | None = field(default=None, compare=False)  # the config it was read from

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ImageProcessor:
        """The processor a config describes; a setting left null is the processor's default, as in transformers."""
        d = {k: v for k, v in config.items() if v is not None}
        kind = d.get("image_processor_type", "CLIPImageProcessor").removesuffix("Fast").removesuffix("Pil")
        if kind not in _SUPPORTED:
            raise ImageError(f"image processor {kind!r} is not supported (supported: {', '.join(_SUPPORTED)})")
        clip, gemma3, onevision = kind not in _SQUARE, kind == "Gemma3ImageProcessor", "Onevision" in kind
        pan_and_scan = None
        if gemma3 and d.get("do_pan_and_scan"):  # its defaults are Gemma3Processor's
            pan_and_scan = PanAndScan(int(d.get("pan_and_scan_min_crop_size", 256)),
                                      int(d.get("pan_and_scan_max_num_crops", 4)),
                                      float(d.get("pan_and_scan_min_ratio_to_activate", 1.2)))
        pinpoints = d.get("image_grid_pinpoints", ONEVISION_PINPOINTS if onevision else NEXT_PINPOINTS)
        size = d.get("size", {"shortest_edge": 224} if clip and not onevision else
                     {"height": 384 if onevision else 224, "width": 384 if onevision else 224})
        if isinstance(size, int):
            size = {"shortest_edge": size} if clip else {"height": size, "width": size}
        if "shortest_edge" in size and "longest_edge" not in size:
            resize = ("shortest_edge", int(size["shortest_edge"]), 0)
        elif "height" in size and "width" in size:
            resize = ("fixed", int(size["height"]), int(size["width"]))
        else:
            raise ImageError(f"image processor size {size} is not supported")
        crop = d.get("crop_size", {"height": 224, "width": 224})
        crop = (crop, crop) if isinstance(crop, int) else (int(crop["height"]), int(crop["width"]))
        mean = d.get("image_mean", (0.48145466, 0.4578275, 0.40821073) if clip else (0.5, 0.5, 0.5))
        std = d.get("image_std", (0.26862954, 0.26130258, 0.27577711) if clip else (0.5, 0.5, 0.5))
        return cls(
            resize=resize if d.get("do_resize", True) else None, resample=int(d.get("resample", 2 if gemma3 else 3)),
            crop=crop if d.get("do_center_crop", clip and not onevision) and not gemma3 else None,  # (Gemma 3's never)
            rescale=float(d.get("rescale_factor", 1 / 255)) if d.get("do_rescale", True) else None,
            mean=tuple(mean) if d.get("do_normalize", True) else None, std=tuple(std),
            convert_rgb=bool(d.get("do_convert_rgb", True)),
            grid_pinpoints=tuple(tuple(p) for p in pinpoints) if "Llava" in kind else None,
            pan_and_scan=pan_and_scan, source=dict(config))

    @classmethod
    def from_dir(cls, path: str) -> ImageProcessor:
        """The processor an HF model directory declares (`preprocessor_config`)."""
        return cls.from_dict(preprocessor_config(path))

    def __call__(self, image) -> np.ndarray:
        """The image as float32 pixels [C, H, W], normalized; a LLaVA-NeXT processor's: its crops [n, C, S, S], the
        whole image first (`crops`)."""
        image = _rgb(image) if self.convert_rgb else image
        if self.grid_pinpoints is not None:
            return self.crops(image)
        boxes = self.pan_and_scan.boxes(*image.size) if self.pan_and_scan is not None else []
        if boxes:
            return np.stack([self._finish(self._resized(piece)) for piece in [image, *map(image.crop, boxes)]])
        return self._finish(self._resized(image))

    def whole(self, image) -> np.ndarray:
        """The image as one crop's pixels [C, H, W] (resized, rescaled, normalized; never cut into crops)."""
        return self._finish(self._resized(_rgb(image) if self.convert_rgb else image))

    def _resized(self, image):
        if self.resize is None:
            return image
        w, h = image.size
        if self.resize[0] == "shortest_edge":
            n = self.resize[1]
            short, long = (w, h) if w <= h else (h, w)
            new_long = int(n * long / short)
            h, w = (new_long, n) if w <= h else (n, new_long)
        else:
            h, w = self.resize[1], self.resize[2]
        return self._resize(image, h, w)

    def _resize(self, image, height: int, width: int):
        return image.resize((width, height), resample=_pil().Resampling(self.resample))

    def crops(self, image) -> np.ndarray:
        """LLaVA-NeXT's crops as transformers' processor makes them: the whole image resized to one crop, then the
        image resized into the best-fitting resolution (`best_resolution`; aspect kept, zero-padded around) and
        cut into crops, row by row."""
        Image = _pil()
        w, h = image.size
        best_h, best_w = best_resolution((h, w), self.grid_pinpoints)
        new_h, new_w = fit_size((h, w), (best_h, best_w))
        fitted = np.array(self._resize(image, new_h, new_w))
        top, left = (best_h - new_h) // 2, (best_w - new_w) // 2
        padded = np.zeros((best_h, best_w, fitted.shape[-1]), np.uint8)
        padded[top:top + new_h, left:left + new_w] = fitted
        side = self.crop[0] if self.crop is not None else self.resize[1]
        size = self.resize[1]
        pieces = [self._resize(image, size, size)] + [
            Image.fromarray(padded[i:i + side, j:j + side]) for i in range(0, best_h, side) for j in range(0, best_w, side)]
        return np.stack([self._finish(self._resized(piece)) for piece in pieces])

    def _finish(self, image) -> np.ndarray:
        """Crop, rescale and normalize a resized image."""
        pixels = np.array(image)
        pixels = (pixels[None] if pixels.ndim == 2 else np.moveaxis(pixels, -1, 0))  # [C, H, W]
        if self.crop is not None:
            pixels = _center_crop(pixels, *self.crop)
        out = pixels.astype(np.float64) * self.rescale if self.rescale is not None else pixels
        out = out.astype(np.float32)
        if self.mean is not None:
            mean = np.asarray(self.mean, np.float32)[:, None, None]
            std = np.asarray(self.std, np.float32)[:, None, None]
            out = (out - mean) / std
        return out


def checked_patches(patches: np.ndarray, patch_dim: int) -> np.ndarray:
    """A processor's flattened patches [n, patch_dim], refused by their shape if the tower cannot take them."""
    if patches.ndim != 2 or patches.shape[1] != patch_dim:
        raise ImageError(f"the image processor made patches of shape {patches.shape}; the vision tower takes "
                         f"{patch_dim} values a patch")
    return patches


def scaled_pixels(image, size: tuple[int, int], resample: int, rescale: float | None,
                  mean: tuple[float, ...] | None, std: tuple[float, ...]) -> np.ndarray:
    """A PIL image resized to (height, width) `size` (when it differs) with `resample`, as float32 pixels [C, H, W],
    rescaled and (with `mean`) normalized per channel, as transformers' PIL processors compute them."""
    height, width = size
    if (height, width) != (image.height, image.width):
        image = image.resize((width, height), resample=_pil().Resampling(resample))
    pixels = np.array(image)
    pixels = pixels[None] if pixels.ndim == 2 else np.moveaxis(pixels, -1, 0)  # [C, H, W]
    if rescale is not None:
        pixels = (pixels.astype(np.float64) * rescale).astype(np.float32)
    pixels = pixels.astype(np.float32)
    if mean is not None:
        if pixels.shape[0] != len(mean):
            raise ImageError(f"an image of {pixels.shape[0]} channels: the processor normalizes {len(mean)} (turn "
                             "do_convert_rgb on)")
        pixels = (pixels - np.asarray(mean, np.float32)[:, None, None]) / np.asarray(std, np.float32)[:, None, None]
    return np.ascontiguousarray(pixels, np.float32)


def best_resolution(size: tuple[int, int], pinpoints: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """transformers' `select_best_resolution`: of the (height, width) pinpoints, the one keeping most of the
    image's pixels once it is scaled to fit, then the one wasting fewest."""
    h, w = size
    best, most, waste = pinpoints[0], 0, float("inf")
    for ph, pw in pinpoints:
        scale = min(pw / w, ph / h)
        effective = min(int(w * scale) * int(h * scale), w * h)
        wasted = ph * pw - effective
        if effective > most or (effective == most and wasted < waste):
            best, most, waste = (ph, pw), effective, wasted
    return best


def fit_size(size: tuple[int, int], target: tuple[int, int]) -> tuple[int, int]:
    """transformers' `get_patch_output_size`: the image's (height, width) scaled to fit `target`, aspect kept."""
    h, w = size
    th, tw = target
    if tw / w < th / h:
        return min(math.ceil(h * tw / w), th), tw
    return th, min(math.ceil(w * th / h), tw)


def _center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """transformers' center crop: the middle (top and left rounded down), zero-padded where the image is smaller."""
    _, h, w = pixels.shape
    if h < height or w < width:
        nh, nw = max(h, height), max(w, width)
        padded = np.zeros(pixels.shape[:-2] + (nh, nw), pixels.dtype)
        top, left = -(-(nh - h) // 2), -(-(nw - w) // 2)
        padded[:, top:top + h, left:left + w] = pixels
        pixels, h, w = padded, nh, nw
    top, left = (h - height) // 2, (w - width) // 2
    return pixels[:, top:top + height, left:left + width]


def pixels_digest(pixels: np.ndarray, size: tuple[int, int]) -> bytes:
    """What identifies an image to the prefix cache: a hash of its processed pixels and its (height, width)."""
    h = hashlib.sha256(np.ascontiguousarray(pixels).tobytes())
    h.update(repr((pixels.shape, tuple(size))).encode())
    return h.digest()


# The settings `--mm-processor-kwargs` may change, by processor (`ImageProcessor.from_dir`'s and the others').
PROCESSOR_SETTINGS = {"qwen2_vl": ("min_pixels", "max_pixels", "size", "fps", "min_frames", "max_frames",
                                   "do_sample_frames"),
                      "pixtral": ("size",), "gemma4": ("max_soft_tokens",), "internvl": ("crop_to_patches", "min_patches", "max_patches", "num_frames"),
                      "llava": ("do_pan_and_scan", "pan_and_scan_min_crop_size", "pan_and_scan_max_num_crops",
                                "pan_and_scan_min_ratio_to_activate")}


def preprocessor_config(path: str, kwargs: Mapping[str, Any] | None = None, kind: str = "llava") -> dict[str, Any]:
    """The image processor's settings an HF model directory declares (`preprocessor_config.json`, or the
    `image_processor` of `processor_config.json`), with `--mm-processor-kwargs` over them: only the settings
    `PROCESSOR_SETTINGS[kind]` names."""
    other = sorted(set(kwargs or {}) - set(PROCESSOR_SETTINGS[kind]))
    if other:
        raise ValueError(f"mm_processor_kwargs {other}: this model's image processor takes "
                         f"{', '.join(PROCESSOR_SETTINGS[kind])}")
    if (found := first_settings(path, (("preprocessor_config.json", None),
                                       ("processor_config.json", "image_processor")))) is not None:
        return {**found, **(kwargs or {})}
    from jaxserve.loader.mistral_dir import image_processor_settings

    if (mistral := image_processor_settings(path)) is not None:  # (Mistral's own format: mistral_common's)
        return {**mistral, **(kwargs or {})}
    raise ImageError(f"{path} has no preprocessor_config.json: its image processing is unknown")


def first_settings(path: str, places: tuple[tuple[str, str | None], ...]) -> dict[str, Any] | None:
    """The first non-empty settings in a model directory's `places`: (file, the key holding them or None: all)."""
    for name, key in places:
        file = os.path.join(path, name)
        if os.path.isfile(file):
            with open(file) as f:
                d = json.load(f)
            if d := d.get(key) if key else d:
                return d
    return None
