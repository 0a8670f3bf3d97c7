"""The engine's flags for image and video inputs (vLLM's names), and the check of `--limit-mm-per-prompt`."""

from __future__ import annotations

from typing import Any


def image_limits(value: Any) -> dict[str, int]:
    """vLLM's `--limit-mm-per-prompt` (a JSON object or a mapping) checked: images and videos, counts >= 0."""
    from jaxserve.json_options import json_object

    limits = dict(json_object(value, "limit_mm_per_prompt", '{"image": 2}'))
    other = sorted(set(limits) - {"image", "video"})
    if other:
        raise ValueError(f"limit_mm_per_prompt names {other}: only 'image' and 'video' inputs are served")
    for kind, n in limits.items():
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"limit_mm_per_prompt {kind} must be an integer >= 0, got {n!r}")
    return limits


def media_io_options(value: Any) -> dict[str, Any]:
    """vLLM's `--media-io-kwargs` (a JSON object or a mapping) checked: {"video": {"num_frames": n}}, the frames a
    video file is sampled to (evenly, first and last included; -1: every frame), before the model's processor."""
    from jaxserve.json_options import json_object

    example = '{"video": {"num_frames": 32}}'
    options = {k: dict(json_object(v, f"media_io_kwargs {k}", example, known={"num_frames"}))
               for k, v in json_object(value, "media_io_kwargs", example, known={"video"}).items()}
    n = options.get("video", {}).get("num_frames")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not (n == -1 or n >= 1)):
        raise ValueError(f"media_io_kwargs video num_frames must be an integer >= 1 (or -1: every frame), got {n!r}")
    return options


def add_image_args(parser) -> None:
    """The engine's flags for image and video inputs."""
    g = parser.add_argument_group("images")
    g.add_argument("--limit-mm-per-prompt", default=None, metavar="JSON",
                   help='most images and videos per prompt, e.g. \'{"image": 2, "video": 1}\' (default: no limit); '
                        '{"image": 0} serves an image-text model as text, without loading its vision tower')
    g.add_argument("--mm-processor-cache-gb", type=float, default=4.0, metavar="GIB",
                   help="host memory for the embeddings of images seen before, by their pixels' hash (a "
                        "conversation sends its images again each turn); 0 turns it off")
    g.add_argument("--mm-processor-kwargs", default=None, metavar="JSON",
                   help="the image (and video) processor's settings over the model's, e.g. '{\"max_pixels\": 1003520}' "
                        "for Qwen2-VL (at most 1280 tokens an image); each processor names the settings it takes")
    g.add_argument("--media-io-kwargs", default=None, metavar="JSON",
                   help='how media are read, e.g. \'{"video": {"num_frames": 32}}\': the frames a video file is '
                        "sampled to (evenly; -1 every frame) before the model's video processor (default: its own "
                        "sampling)")
    g.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="a directory whose image and video files requests may name (a path or a file:// URL); "
                        "without it only data: and http(s) URLs are read")
