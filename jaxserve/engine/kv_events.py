"""KV cache events: what the prefix cache stores and drops, for routers that track replicas.

The shapes follow vLLM's KV event stream (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``) so a prefix-aware router can consume either. A block is
one full page of ``page_size`` tokens. Its hash chains over the whole prefix:

    hash_i = H(hash_{i-1}, tokens of page i, cache salt)

with ``H`` a SHA-256 over a fixed byte encoding, truncated to 64 bits. The
hash is therefore a function of (salt, every token up to the end of the
page) and is the same in every process and on every host; Python's ``hash``
is salted per process and is never used here.
"""

from __future__ import annotations

import collections
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

_NONE = b"\x00"
_SOME = b"\x01"


def hash_block(parent_hash: int | None, token_ids: Sequence[int], salt: str | None = None) -> int:
    """Chained 64-bit hash of one page of tokens given its parent page's hash."""
    h = hashlib.sha256()
    # Length prefixes and presence markers keep the encoding unambiguous, so
    # (salt=None) and (salt="") or two different splits never collide by construction.
    if parent_hash is None:
        h.update(_NONE)
    else:
        h.update(_SOME + struct.pack("<Q", parent_hash))
    if salt is None:
        h.update(_NONE)
    else:
        salt_bytes = salt.encode("utf-8")
        h.update(_SOME + struct.pack("<I", len(salt_bytes)) + salt_bytes)
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    return int.from_bytes(h.digest()[:8], "little")


def hash_token_pages(
    token_ids: Sequence[int],
    page_size: int,
    salt: str | None = None,
    parent_hash: int | None = None,
) -> list[int]:
    """Chained hashes of every full page of ``token_ids`` (a trailing partial page is ignored)."""
    hashes = []
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        parent_hash = hash_block(parent_hash, token_ids[start : start + page_size], salt)
        hashes.append(parent_hash)
    return hashes


@dataclass(frozen=True)
class BlockStored:
    """Consecutive pages entered the prefix cache.

    ``block_hashes[0]`` chains from ``parent_block_hash`` (None at the start
    of a prompt); ``token_ids`` holds ``len(block_hashes) * page_size`` ids.
    """

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    page_size: int


@dataclass(frozen=True)
class BlockRemoved:
    """Pages left the prefix cache (evicted); their hashes are no longer served."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBuffer:
    """A subscriber that queues events until someone drains them (off the per-token path).

    Appends and pops on a deque are atomic in CPython, so the engine thread may
    publish while another thread drains. ``max_events`` bounds memory if nobody
    drains: the oldest events are dropped and counted in ``num_dropped``.
    """

    def __init__(self, max_events: int = 100_000) -> None:
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        self._events: collections.deque[KVEvent] = collections.deque()
        self._max_events = max_events
        self.num_dropped = 0

    def __call__(self, event: KVEvent) -> None:
        """Queue one event."""
        if len(self._events) >= self._max_events:
            self._events.popleft()
            self.num_dropped += 1
        self._events.append(event)

    def __len__(self) -> int:
        return len(self._events)

    def drain(self) -> list[KVEvent]:
        """Remove and return the queued events, oldest first."""
        out = []
        while self._events:
            out.append(self._events.popleft())
        return out
