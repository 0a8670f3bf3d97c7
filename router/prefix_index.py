"""Which prompt pages each worker holds: exact from its KV events, approximate from past routing.

Pages are named by the engine's chained block hashes (`jaxserve.engine.kv_events.hash_token_pages`),
so a request's pages are hashed here exactly as the worker hashed them, and the longest cached
prefix of a request on a worker is the number of its leading hashes that worker holds.

The exact set follows `BlockStored` / `BlockRemoved` / `AllBlocksCleared`. Events lag the request
that caused them (they are published when the prefill completes and read at the next probe), and
a worker may publish none; so every routing decision also records the request's hashes for the
picked worker in an approximate set whose entries expire after `ttl_s`. A worker's match is the
longer of the two.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any


class PrefixIndex:
    """Per-worker block-hash sets (exact and approximate) and longest-prefix matching."""

    def __init__(self, ttl_s: float = 30.0, max_approx: int = 200_000):
        self.ttl_s = ttl_s
        self._max_approx = max_approx
        self._exact: dict[str, set[int]] = collections.defaultdict(set)
        self._approx: dict[str, collections.OrderedDict[int, float]] = collections.defaultdict(
            collections.OrderedDict)
        self._has_events: set[str] = set()
        self._lock = threading.Lock()

    def apply_events(self, worker: str, events: Iterable[dict[str, Any]], reset: bool = False) -> None:
        """Apply a worker's KV events (JSON, as `GET /v1/kv_events` returns them); `reset` first forgets it."""
        with self._lock:
            exact = self._exact[worker]
            if reset:
                exact.clear()
            self._has_events.add(worker)
            for e in events:
                kind = e.get("type")
                if kind == "BlockStored":
                    exact.update(e["block_hashes"])
                elif kind == "BlockRemoved":
                    exact.difference_update(e["block_hashes"])
                elif kind == "AllBlocksCleared":
                    exact.clear()

    def note_routed(self, worker: str, hashes: Sequence[int]) -> None:
        """Remember that `worker` was sent a prompt with these page hashes (it will likely cache them)."""
        now = time.monotonic()
        with self._lock:
            approx = self._approx[worker]
            for h in hashes:
                approx[h] = now
                approx.move_to_end(h)
            while len(approx) > self._max_approx:
                approx.popitem(last=False)

    def forget(self, worker: str) -> None:
        """Drop everything known about `worker` (it left, or its process restarted)."""
        with self._lock:
            self._exact.pop(worker, None)
            self._approx.pop(worker, None)
            self._has_events.discard(worker)

    def is_warm(self, worker: str) -> bool:
        """Whether `worker` publishes KV events (so its exact set is meaningful)."""
        return worker in self._has_events

    def match(self, worker: str, hashes: Sequence[int]) -> tuple[int, str]:
        """Leading pages of `hashes` cached on `worker`, and which index said so ("exact", "approx" or "")."""
        deadline = time.monotonic() - self.ttl_s
        with self._lock:
            exact = self._exact.get(worker, set())
            approx = self._approx.get(worker, {})
            n_exact = 0
            for h in hashes:
                if h not in exact:
                    break
                n_exact += 1
            n_approx = 0
            for h in hashes:
                t = approx.get(h)
                if t is None or t < deadline:
                    break
                n_approx += 1
        if n_exact == 0 and n_approx == 0:
            return 0, ""
        return (n_exact, "exact") if n_exact >= n_approx else (n_approx, "approx")

    def num_exact(self, worker: str) -> int:
        """How many pages `worker`'s events say it caches."""
        with self._lock:
            return len(self._exact.get(worker, ()))
