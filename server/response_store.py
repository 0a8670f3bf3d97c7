"""The responses `/v1/responses` keeps (`store`, OpenAI's default): what `previous_response_id` continues and
`GET /v1/responses/{id}` returns, and the background responses still generating (which
`POST /v1/responses/{id}/cancel` stops). In memory, the newest `capacity` of them; a server restart forgets them."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as it was returned
    # The conversation the response ends, as chat messages: every earlier turn, this request's input and its
    # reply (not its `instructions`, which a continuation does not inherit, as in OpenAI's API).
    history: tuple[dict[str, Any], ...]
    input_items: tuple[dict[str, Any], ...] = ()  # this request's `input`, as input_items lists it


class ResponseStore:
    """Stored responses by id, the oldest dropped past `capacity` (0 stores none)."""

    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self.running: dict[str, asyncio.Task] = {}  # background responses still generating, by id

    def put(self, stored: StoredResponse) -> None:
        if self.capacity == 0:
            return
        self._items[stored.response["id"]] = stored
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._items.get(response_id)

    async def stop(self, response_id: str) -> bool:
        """Cancel the background response `response_id` and wait until it is stored cancelled; False when none
        is generating under that id."""
        task = self.running.get(response_id)
        if task is None:
            return False
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return True

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._items)
