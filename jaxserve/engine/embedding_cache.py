"""Image embeddings kept by their processed pixels' hash, so an image seen before is not encoded again."""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np


class EmbeddingCache:
    """Embeddings (host arrays) by pixel hash, the least recently used dropped past `limit_bytes`; filled from any
    thread (a server encodes images ahead, as they arrive).

    The encoders of a data-parallel engine's replicas share one: an image one replica's encoder met serves them all.
    `generation` counts clears (weight changes): an embedding computed before one is never stored after it. Each
    replica clears it as its weights change, so once all have, no embedding of the old weights is left."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self._items: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.generation = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._items

    def get(self, digest: bytes) -> tuple[np.ndarray | None, int]:
        """The embeddings stored for `digest` (None: none) and the generation to `put` new ones under."""
        with self._lock:
            emb = self._items.get(digest)
            if emb is not None:
                self._items.move_to_end(digest)
            return emb, self.generation

    def put(self, digest: bytes, emb: np.ndarray, generation: int) -> None:
        """Store `emb`, computed in `generation`, unless the cache was cleared since or it does not fit."""
        with self._lock:
            if emb.nbytes > self.limit_bytes or generation != self.generation or digest in self._items:
                return
            self._items[digest] = emb
            self._bytes += emb.nbytes
            while self._bytes > self.limit_bytes:
                self._bytes -= self._items.popitem(last=False)[1].nbytes

    def clear(self) -> None:
        with self._lock:
            self._items, self._bytes = OrderedDict(), 0
            self.generation += 1
