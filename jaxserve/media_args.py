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
    g.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="a directory whose image and video files requests may name (a path or a file:// URL); "
                        "without it only data: and http(s) URLs are read")
