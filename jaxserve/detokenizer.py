"""Streaming token ids back to text: incremental detokenization and stop strings.

`IncrementalDetokenizer` turns each step's new token ids into the new text only. A byte-level token
can hold part of a UTF-8 character (an emoji is often split over several tokens); its text then ends
in U+FFFD, and it is held back until the following tokens complete the character, so a client never
sees a broken character. Each step decodes a short window of recent ids, not the whole output.

`StopChecker` sits after it: it cuts the output at the first stop string (which may span token
boundaries) and holds back any tail that could still become one, so a stop string never streams.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded ahead of the first generated one, so a decoder that treats the start of a
# sequence specially (SentencePiece drops a leading space) decodes the first output as mid-text.
_PROMPT_CONTEXT = 5


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Feeds generated ids in, gets only the new text out; no partial UTF-8 character is ever emitted.

    Invariant: `"".join(all add() results) + flush()` equals `tokenizer.decode(generated_ids)` for a
    byte-level BPE; `text` holds what was emitted so far.
    """

    def __init__(
        self, tokenizer: _Decoder, prompt_ids: Sequence[int] | None = None, skip_special_tokens: bool = True
    ):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        # The window of ids still needed: [prefix, read) already emitted (context), [read, end) pending.
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:]) if prompt_ids else []
        self._prefix = 0
        self._read = len(self._ids)
        self._chunks: list[str] = []
        self.num_generated = 0

    def add(self, token_ids: Sequence[int] | int) -> str:
        """Append newly generated ids; return the text they complete (possibly empty)."""
        if isinstance(token_ids, int):
            token_ids = (token_ids,)
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        self.num_generated += len(token_ids)
        prefix_text = self._tokenizer.decode(self._ids[self._prefix : self._read], self._skip)
        full_text = self._tokenizer.decode(self._ids[self._prefix :], self._skip)
        # Text ending in U+FFFD may be a character whose remaining bytes are in tokens not seen yet.
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            return ""
        delta = full_text[len(prefix_text) :]
        # Keep the last emitted stretch as context for the next window; older ids are no longer needed.
        del self._ids[: self._read]
        self._prefix, self._read = 0, len(self._ids)
        self._chunks.append(delta)
        return delta

    def flush(self) -> str:
        """At the end of generation, emit whatever is held back, broken characters included."""
        prefix_text = self._tokenizer.decode(self._ids[self._prefix : self._read], self._skip)
        full_text = self._tokenizer.decode(self._ids[self._prefix :], self._skip)
        delta = full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""
        del self._ids[: self._read]
        self._prefix, self._read = 0, len(self._ids)
        if delta:
            self._chunks.append(delta)
        return delta

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""


class NoText:
    """In place of an `IncrementalDetokenizer` where the output is not turned into text (`SamplingParams.detokenize`
    False, or an engine without a tokenizer): token ids in, no text out."""

    text = ""

    def add(self, token_ids: Sequence[int] | int) -> str:
        return ""

    def flush(self) -> str:
        return ""


@dataclass(frozen=True)
class StopMatch:
    """Where a text must end because of stop strings, and how much of it may still begin one."""

    end: int  # the text is cut here: its length if no stop string matched
    stop_str: str | None  # the stop string found, None if none
    hold_back: int  # trailing characters of text[:end] not safe to stream yet (0 once stopped)


def find_stop(
    text: str, num_new_chars: int, stop: Sequence[str], include_stop_str_in_output: bool = False
) -> StopMatch:
    """Find the first point where a stop string completes in `text`, looking only at what the new chars can reach.

    The caller promises no stop string completed before the last `num_new_chars` characters (earlier
    calls would have caught it), so only the tail of length `num_new_chars + max(len(stop)) - 1` is
    searched. "First" is the earliest end (ties: the longest string), which is where character-by-
    character checking would have stopped, so the result does not depend on how text was chunked.
    """
    best: tuple[int, int, str] | None = None  # (end, -len, stop string)
    for s in stop:
        start = text.find(s, max(0, len(text) - num_new_chars - len(s) + 1))
        if start >= 0:
            key = (start + len(s), -len(s), s)
            if best is None or key[:2] < best[:2]:
                best = key
    if best is not None:
        stop_end, neg_len, s = best
        return StopMatch(
            end=stop_end if include_stop_str_in_output else stop_end + neg_len, stop_str=s, hold_back=0
        )
    return StopMatch(end=len(text), stop_str=None, hold_back=partial_stop_suffix(text, stop))


def partial_stop_suffix(text: str, stop: Sequence[str]) -> int:
    """Length of the longest end of `text` that is a proper beginning of some stop string."""
    longest = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest


@dataclass(frozen=True)
class StopDelta:
    """One step's output after stop-string handling."""

    text: str  # text safe to stream now
    stop_str: str | None  # set when a stop string ended the output (then `text` is the last piece)


class StopChecker:
    """Cuts streamed text at stop strings, never streaming any part of one that turns out to match.

    Each `add` looks only at the held-back tail and the new text, so it costs O(len(delta) + max
    stop length), not O(output length).
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False):
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.stop = tuple(dict.fromkeys(stop))
        self.include_stop_str_in_output = include_stop_str_in_output
        self._pending = ""  # received but not streamed: it might be the start of a stop string
        self.stop_str: str | None = None

    @property
    def held_back(self) -> str:
        """Text received but not yet streamed."""
        return self._pending

    def add(self, delta: str) -> StopDelta:
        """Take the detokenizer's new text; return what may be streamed and whether a stop string hit."""
        if self.stop_str is not None:
            raise RuntimeError("output already stopped at a stop string")
        if not self.stop:
            return StopDelta(delta, None)
        window = self._pending + delta
        match = find_stop(window, len(delta), self.stop, self.include_stop_str_in_output)
        if match.stop_str is not None:
            self.stop_str = match.stop_str
            self._pending = ""
            return StopDelta(window[: match.end], match.stop_str)
        cut = len(window) - match.hold_back
        self._pending = window[cut:]
        return StopDelta(window[:cut], None)

    def flush(self) -> str:
        """Generation ended for another reason (EOS, length): the held-back text is ordinary output."""
        rest, self._pending = self._pending, ""
        return rest
