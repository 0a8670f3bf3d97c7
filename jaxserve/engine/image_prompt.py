"""A request's images in its prompt (`ImagePrompt`: where each image's tokens are, encoded when first needed) and
in the steps that compute them: their embeddings, their last visible keys, M-RoPE's rotary offsets.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclass
class ImagePrompt:
    """A prompt's images: where each one's tokens sit, what the decoder takes there, and its cache id.

    An image is encoded when a step first computes some of its tokens (`embeds`): one whose pages the prefix cache
    (or a KV transfer) holds is never encoded."""

    spans: list[tuple[int, int]]  # (first position, number of tokens), in prompt order
    keys: list[int]  # each image's negative id in the prefix cache
    bidirectional: bool = False  # an image's tokens attend to each other both ways (Gemma 3)
    images: Sequence[Any] = ()  # each image, as `encode` takes it
    encode: Callable[[Any], np.ndarray] | None = None  # an image's embeddings [tokens, E], in the model's dtype
    grids: Sequence[tuple[int, int, int]] | None = None  # M-RoPE models: each image's tokens as (t, h, w)
    time_steps: Sequence[float] | None = None  # M-RoPE: each one's temporal position step (a video's; None: 1)
    takes: Sequence[np.ndarray] | None = None
    """Per image, which of its span's positions take its embeddings, in order ([n] bool); the others keep their
    tokens' (Pixtral's row breaks). None: all of them."""
    prompt_embeds: bool = False  # the whole prompt given as embeddings (`engine.prompt_embeds`), no images
    _embeds: dict[int, np.ndarray] = field(default_factory=dict, repr=False)

    def embeds(self, i: int) -> np.ndarray:
        """Image i's embeddings, encoded on first use."""
        if i not in self._embeds:
            self._embeds[i] = self.encode(self.images[i])
        return self._embeds[i]

    def _steps(self) -> Sequence[float]:
        return self.time_steps or [1.0] * len(self.spans)

    @staticmethod
    def _extent(grid: tuple[int, int, int], step: float) -> int:
        """The positions an image (or video) takes: one past its largest temporal, row or column index."""
        t, h, w = grid
        return max(int(np.float32(t - 1) * np.float32(step)) + 1, h, w)

    @property
    def rope_delta(self) -> int:
        """M-RoPE: what the rotary positions of the tokens after the last image add to their positions (each image
        takes as many positions as its longest side has tokens: fewer than its tokens)."""
        return sum(self._extent(g, s) - n for (_, n), g, s in zip(self.spans, self.grids or (), self._steps(),
                                                                   strict=False))

    def rope_offsets(self, start: int, count: int, out: np.ndarray) -> None:
        """M-RoPE (`ModelInputs.rope_offsets`): positions [start, start + count)'s offsets into `out` [3, count]:
        an image token's temporal (times its `time_steps`, rounded down), height and width indices in its image from
        the image's first position, a text token's the deltas of the images before it (`rope_delta`)."""
        delta = 0
        for (first, n), (t, h, w), step in zip(self.spans, self.grids or (), self._steps(), strict=True):
            lo, hi = max(start, first), min(start + count, first + n)
            if lo < hi:
                k = np.arange(lo - first, hi - first)
                frame = ((k // (h * w)).astype(np.float32) * np.float32(step)).astype(np.int64)  # (as transformers)
                out[:, lo - start:hi - start] = delta + np.stack([frame, k // w % h, k % w]) - k
            delta += self._extent((t, h, w), step) - n
            out[:, max(0, first + n - start):] = delta

    def encode_range(self, start: int, count: int) -> None:
        """Encode the images positions [start, start + count) reach (those not encoded yet)."""
        for i, (first, n) in enumerate(self.spans):
            if max(start, first) < min(start + count, first + n):
                self.embeds(i)

    @property
    def whole_spans(self) -> tuple[tuple[int, int], ...]:
        """The positions [start, end) a prefill chunk must hold whole: each image's, when attended both ways."""
        return tuple((first, first + n) for first, n in self.spans) if self.bidirectional else ()

    def cache_ids(self, ids: Sequence[int]) -> list[int]:
        """The prompt as the prefix cache keys it (and as the engine feeds it): each image's tokens as that image's
        id; the text in a span (`takes`) as it is."""
        out = list(ids)
        for i, ((start, n), key) in enumerate(zip(self.spans, self.keys, strict=True)):
            out[start:start + n] = [key] * n if self.takes is None else \
                np.where(self.takes[i], key, ids[start:start + n]).tolist()
        return out

    def fill(self, start: int, count: int, out: np.ndarray, mask: np.ndarray, t0: int, last: np.ndarray) -> None:
        """The embeddings of positions [start, start + count) that are image tokens, into `out` rows from t0, and
        when attended both ways, each one's last visible key (its image's last position) into `last`."""
        for i, (first, n) in enumerate(self.spans):
            lo, hi = max(start, first), min(start + count, first + n)
            if lo < hi:
                at = slice(t0 + lo - start, t0 + hi - start)
                if self.takes is None:
                    out[at], mask[at] = self.embeds(i)[lo - first:hi - first], True
                else:  # the embedding rows of the positions that take one
                    takes = self.takes[i][lo - first:hi - first]
                    rows = (np.cumsum(self.takes[i]) - 1)[lo - first:hi - first]
                    out[at][takes], mask[at] = self.embeds(i)[rows[takes]], takes
                if self.bidirectional:
                    last[t0 + lo - start:t0 + hi - start] = first + n - 1


def encode_step_images(rows: Sequence[Any], group_of: Mapping[str, Any]) -> dict[str, Exception]:
    """Encode the images the rows' (`ScheduledRequest`s) prefill chunks reach, before their step is built: the
    requests (group ids) whose image failed to encode, with the error, so that they alone fail."""
    failed: dict[str, Exception] = {}
    for s in rows:
        group = group_of.get(s.request_id)
        if group is None or group.images is None or s.is_decode:
            continue
        try:
            group.images.encode_range(s.start_position, s.num_new_tokens)
        except Exception as e:  # noqa: BLE001 - that request fails, the step goes on without it
            failed[group.request_id] = e
    return failed


def step_rope_offsets(rows: Sequence[Any], image_prompt: Callable[[str], ImagePrompt | None],
                      num_tokens: int) -> np.ndarray:
    """M-RoPE: the rotary offsets ([3, T] int32, `ModelInputs.rope_offsets`) of a mixed step's packed tokens, for
    rows (`ScheduledRequest`s) in packing order."""
    out = np.zeros((3, num_tokens), np.int32)
    t0 = 0
    for s in rows:
        prompt = image_prompt(s.request_id)
        if prompt is not None and prompt.grids is not None:
            prompt.rope_offsets(s.start_position, s.num_new_tokens, out[:, t0:t0 + s.num_new_tokens])
        t0 += s.num_new_tokens
    return out


def step_embeds(rows: Sequence[Any], image_prompt: Callable[[str], ImagePrompt | None], num_tokens: int,
                hidden: int, dtype: Any, spans: bool = False) -> tuple[jax.Array, jax.Array, jax.Array | None] | None:
    """The image embeddings of a mixed step's packed tokens ([T, E]), which tokens take them ([T] bool) and, with
    `spans` (images attended both ways), each token's last visible key ([T] int32, 0 for a causal token), for rows
    (`ScheduledRequest`s) in packing order; None when no row has an image token."""
    out = mask = last = None
    t0 = 0
    for s in rows:
        prompt = image_prompt(s.request_id)
        if prompt is not None and not s.is_decode:
            if out is None:
                out, mask = np.zeros((num_tokens, hidden), dtype), np.zeros(num_tokens, np.bool_)
                last = np.zeros(num_tokens, np.int32)
            prompt.fill(s.start_position, s.num_new_tokens, out, mask, t0, last)
        t0 += s.num_new_tokens
    if out is None or not mask.any():
        return None
    return jnp.asarray(out), jnp.asarray(mask), jnp.asarray(last) if spans else None
