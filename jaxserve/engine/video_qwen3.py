"""Qwen3-VL's videos in a prompt: each temporal patch written as its own image-like span after its time, as its
processor writes them: `<{t:.1f} seconds><|vision_start|>` + the patch's `<|video_pad|>` tokens + `<|vision_end|>`
for every patch, where the chat template wrote the video's `<|vision_start|><|video_pad|><|vision_end|>` (a bare
`<|video_pad|>` likewise). Each patch's tokens turn by (0, row, column) from their first position, as an image's, and
the time texts between them are text; in the tower each patch is encoded as the image it is (its two frames), so a
video is its patches, items of their own for the prompt, the caches and the steps (`frames_of`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

from jaxserve.engine.multimodal import PreparedVideo


def frames_of(video: PreparedVideo) -> list[PreparedVideo]:
    """A Qwen3-VL video's temporal patches, each one an item of grid (1, h, w) keyed by the video and its place."""
    t, h, w = video.grid
    return [PreparedVideo(video.pixels[i * h * w:(i + 1) * h * w], video.size,
                          hashlib.sha256(video.digest + i.to_bytes(4, "little")).digest(), (1, h, w), 1.0)
            for i in range(t)]


def timestamped(ids: Sequence[int], videos: Sequence[PreparedVideo], tokens: Sequence[int],
                time_ids: Callable[[float], list[int]], start: int, end: int, pad: int) -> list[int]:
    """`ids` with the i-th video's placeholder written as its patches' times and placeholders (`tokens[i]` pads a
    patch; `time_ids(t)`: the ids of "<t seconds>"). A video already written so (the prompt expanded before) is kept
    as it is; any other run of pads is the caller's to match (and refuse)."""
    out: list[int] = []
    i = v = 0
    while i < len(ids):
        if ids[i] != pad or v >= len(videos):
            out.append(ids[i])
            i += 1
            continue
        video, n = videos[v], tokens[v]
        v += 1
        seq = [x for at in video.timestamps for x in (*time_ids(at), start, *[pad] * n, end)]
        head = time_ids(video.timestamps[0]) + [start]
        if i >= len(head) and list(ids[i - len(head):i - len(head) + len(seq)]) == seq:
            out.extend(seq[len(head):])  # written before (its first time and start are in `out` already)
            i += len(seq) - len(head)
        elif i > 0 and ids[i - 1] == start and i + 1 < len(ids) and ids[i + 1] == end and out and out[-1] == start:
            out[-1:] = seq  # the template's start and end around the one pad become the first's and the last's
            i += 2
        else:
            out.extend(seq)
            i += 1
    return out
