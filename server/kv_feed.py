"""The worker's KV events as a numbered feed that routers poll: `GET /v1/kv_events?since=N`.

The engine's prefix cache publishes `BlockStored` / `BlockRemoved` / `AllBlocksCleared` (the
shapes vLLM publishes) on the engine thread; the feed numbers them and keeps the newest
`max_events`. A reader passes the number after the last event it saw. The answer carries the
feed's `epoch` (new in every process) and `truncated` when events it asked for were already
dropped: in both cases the reader must forget what it knew of this worker and start over.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


def event_to_json(event: KVEvent) -> dict[str, Any]:
    """One event as JSON (64-bit hashes stay integers)."""
    if isinstance(event, BlockStored):
        return {"type": "BlockStored", "block_hashes": list(event.block_hashes),
                "parent_block_hash": event.parent_block_hash, "token_ids": list(event.token_ids),
                "page_size": event.page_size}
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes)}
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {event!r}")


class KVEventFeed:
    """Numbered KV events of one worker, filled by the engine thread, read by HTTP handlers."""

    def __init__(self, max_events: int = 100_000):
        self.epoch = uuid.uuid4().hex
        self._events: collections.deque[tuple[int, dict[str, Any]]] = collections.deque(maxlen=max_events)
        self._next = 0
        self._lock = threading.Lock()
        self._subscribed: bool | None = None  # None: not tried yet; False: the engine has no events

    def publish(self, event: KVEvent) -> None:
        """Append one event (called on the engine thread)."""
        item = event_to_json(event)
        with self._lock:
            self._events.append((self._next, item))
            self._next += 1

    async def attach(self, engine: Any) -> bool:
        """Subscribe to `engine`'s KV events once it is ready; False if it publishes none."""
        if self._subscribed is None and getattr(engine, "is_ready", False):
            subscribe = getattr(engine, "subscribe_kv_events", None)
            if subscribe is None:
                self._subscribed = False
            else:
                self._subscribed = bool(await asyncio.to_thread(subscribe, self.publish))
        return bool(self._subscribed)

    def since(self, n: int, limit: int = 10_000) -> dict[str, Any]:
        """Events numbered `n` and later (at most `limit`), the number to ask for next, and `truncated`."""
        with self._lock:
            first = self._events[0][0] if self._events else self._next
            events = [e for i, e in self._events if i >= n][:limit]
            nxt = max(n, first) + len(events)
            return {"epoch": self.epoch, "next": nxt, "truncated": n < first, "events": events}


async def kv_events(request: Request) -> Response:
    """`GET /v1/kv_events?since=N`: this worker's KV events from number N on (404 if it publishes none)."""
    from server.errors import ApiError

    feed: KVEventFeed = request.app.state.kv_feed
    if not await feed.attach(request.app.state.server.engine):
        raise ApiError(404, "this worker publishes no KV events (not ready, or prefix caching is off)",
                       code="not_found")
    raw = request.query_params.get("since", "0")
    if not raw.isdigit():
        raise ApiError(400, "'since' must be a non-negative integer", param="since")
    return JSONResponse(feed.since(int(raw)))
