"""OpenAI's Conversations API: a conversation kept on the server, which responses read and extend.

`POST /v1/conversations` creates one (with optional first `items` and `metadata`); `GET`, `POST` (new
`metadata`) and `DELETE /v1/conversations/{id}` read, update and forget it. Its items are listed a page at a
time by `GET /v1/conversations/{id}/items` (`limit` 1-100, `order` asc or desc, `after` an item id), added by
`POST .../items`, read and removed one at a time by `GET` and `DELETE .../items/{item_id}`. Items are the
Responses API's input items (messages, `function_call`, `function_call_output`, `reasoning`), each with an id.

`POST /v1/responses` with `conversation` (an id, or `{"id": ...}`) puts the conversation's items before its
`input`, and once the response has finished (completed or incomplete) adds its input items and its output
items to the conversation. Conversations live in memory, the newest `capacity` of them (the responses store's),
and a restart forgets them.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from server.errors import ApiError, bad_field
from server.responses_input import input_messages, listed_input_items

_MAX_METADATA = 16  # OpenAI's limits on metadata: 16 pairs, keys of 64 characters, values of 512
_MAX_ITEMS_PER_CALL = 20


@dataclass
class Conversation:
    id: str
    created_at: int
    metadata: dict[str, str]
    items: list[dict[str, Any]] = field(default_factory=list)  # oldest first, each with its id

    def json(self) -> dict[str, Any]:
        return {"id": self.id, "object": "conversation", "created_at": self.created_at, "metadata": self.metadata}


class ConversationStore:
    """Conversations by id, the least recently created dropped past `capacity` (0 keeps none)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: OrderedDict[str, Conversation] = OrderedDict()

    def create(self, metadata: dict[str, str], items: Sequence[dict[str, Any]]) -> Conversation:
        if self.capacity == 0:
            raise ApiError(400, "this server keeps no conversations (--responses-store-capacity 0)",
                           code="unsupported_parameter")
        conv = Conversation(f"conv_{uuid.uuid4().hex}", int(time.time()), metadata, list(items))
        self._items[conv.id] = conv
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)
        return conv

    def get(self, conversation_id: Any, param: str = "conversation_id") -> Conversation:
        """The conversation `conversation_id`; 404 naming `param` when none is kept under it."""
        conv = self._items.get(conversation_id) if isinstance(conversation_id, str) else None
        if conv is None:
            raise ApiError(404, f"no conversation with id {conversation_id!r} (conversations are kept in memory, "
                                f"the newest {self.capacity})", param=param, code="not_found")
        return conv

    def delete(self, conversation_id: str) -> None:
        self._items.pop(self.get(conversation_id).id)


def conversation_of(store: ConversationStore, body: Mapping[str, Any]) -> Conversation | None:
    """The conversation a `/v1/responses` body names in `conversation` (an id or `{"id": ...}`), if any."""
    value = body.get("conversation")
    if value is None:
        return None
    if body.get("previous_response_id") is not None:
        raise bad_field("conversation", "'conversation' and 'previous_response_id' cannot be combined: a "
                                        "conversation holds the earlier turns itself")
    conversation_id = value.get("id") if isinstance(value, Mapping) else value
    if not isinstance(conversation_id, str):
        raise bad_field("conversation", "'conversation' must be a conversation id or an object with its 'id'",
                        "invalid_type")
    return store.get(conversation_id, "conversation")


def history_of(conv: Conversation) -> tuple[dict[str, Any], ...]:
    """The conversation's items as the chat messages that come before a response's input."""
    return tuple(input_messages({"input": conv.items})) if conv.items else ()


def _metadata(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or len(value) > _MAX_METADATA or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in value.items()):
        raise bad_field("metadata", f"'metadata' must be an object of at most {_MAX_METADATA} string values "
                                    "(keys up to 64 characters, values up to 512)", "invalid_value")
    return dict(value)


def _new_items(value: Any, *, required: bool) -> list[dict[str, Any]]:
    """`items` as a request gives them, checked as Responses input items and listed with ids."""
    if value is None and not required:
        return []
    if not isinstance(value, list) or (required and not value) or len(value) > _MAX_ITEMS_PER_CALL:
        raise bad_field("items", f"'items' must be a list of 1 to {_MAX_ITEMS_PER_CALL} input items", "invalid_value")
    if not value:
        return []
    try:
        input_messages({"input": value})
    except ApiError as e:  # its message names the item (as input[i]); the field is this request's `items`
        raise bad_field("items", e.message.replace("input[", "items["), e.code) from e
    return list(listed_input_items({"input": value}, f"item_{uuid.uuid4().hex[:12]}"))


async def _json_body(request: Request) -> Mapping[str, Any]:
    from server.serving import read_json

    body = await read_json(request, request.app.state.server.config.max_request_body_bytes)
    if not isinstance(body, Mapping):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_type")
    return body


def _store(request: Request) -> ConversationStore:
    return request.app.state.server.conversations


def list_page(items: Sequence[dict[str, Any]], request: Request, default_order: str) -> dict[str, Any]:
    """One page of `items` (oldest first) as OpenAI lists them, by the request's query: `order` (asc or desc),
    `limit` 1-100 (20), `after` an item id."""
    q = request.query_params
    order, limit, after = q.get("order", default_order), q.get("limit", "20"), q.get("after")
    if order not in ("asc", "desc"):
        raise ApiError(400, f"'order' must be asc or desc, got {order!r}", param="order", code="invalid_value")
    if not limit.isdigit() or not 1 <= int(limit) <= 100:
        raise ApiError(400, f"'limit' must be an integer from 1 to 100, got {limit!r}", param="limit",
                       code="invalid_value")
    ordered = list(items) if order == "asc" else list(items)[::-1]
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise ApiError(400, f"'after': no item {after!r} here", param="after", code="invalid_value")
        ordered = ordered[ids.index(after) + 1:]
    page = ordered[:int(limit)]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(ordered) > len(page)}


async def create_conversation(request: Request) -> Response:
    body = await _json_body(request)
    conv = _store(request).create(_metadata(body.get("metadata")), _new_items(body.get("items"), required=False))
    return JSONResponse(conv.json())


async def get_conversation(request: Request) -> Response:
    return JSONResponse(_store(request).get(request.path_params["conversation_id"]).json())


async def update_conversation(request: Request) -> Response:
    conv = _store(request).get(request.path_params["conversation_id"])
    body = await _json_body(request)
    if "metadata" not in body:
        raise bad_field("metadata", "updating a conversation sets its 'metadata', which is missing",
                        "missing_required_parameter")
    conv.metadata = _metadata(body["metadata"])
    return JSONResponse(conv.json())


async def delete_conversation(request: Request) -> Response:
    conversation_id = request.path_params["conversation_id"]
    _store(request).delete(conversation_id)
    return JSONResponse({"id": conversation_id, "object": "conversation.deleted", "deleted": True})


async def list_items(request: Request) -> Response:
    conv = _store(request).get(request.path_params["conversation_id"])
    return JSONResponse(list_page(conv.items, request, "desc"))


async def add_items(request: Request) -> Response:
    conv = _store(request).get(request.path_params["conversation_id"])
    added = _new_items((await _json_body(request)).get("items"), required=True)
    conv.items.extend(added)
    return JSONResponse({"object": "list", "data": added, "first_id": added[0]["id"], "last_id": added[-1]["id"],
                         "has_more": False})


def _item_index(conv: Conversation, item_id: str) -> int:
    for i, item in enumerate(conv.items):
        if item["id"] == item_id:
            return i
    raise ApiError(404, f"no item {item_id!r} in conversation {conv.id!r}", param="item_id", code="not_found")


async def get_item(request: Request) -> Response:
    conv = _store(request).get(request.path_params["conversation_id"])
    return JSONResponse(conv.items[_item_index(conv, request.path_params["item_id"])])


async def delete_item(request: Request) -> Response:
    conv = _store(request).get(request.path_params["conversation_id"])
    del conv.items[_item_index(conv, request.path_params["item_id"])]
    return JSONResponse(conv.json())


def conversation_routes() -> list[Route]:
    base = "/v1/conversations"
    return [
        Route(base, create_conversation, methods=["POST"]),
        Route(base + "/{conversation_id}", get_conversation, methods=["GET"]),
        Route(base + "/{conversation_id}", update_conversation, methods=["POST"]),
        Route(base + "/{conversation_id}", delete_conversation, methods=["DELETE"]),
        Route(base + "/{conversation_id}/items", list_items, methods=["GET"]),
        Route(base + "/{conversation_id}/items", add_items, methods=["POST"]),
        Route(base + "/{conversation_id}/items/{item_id}", get_item, methods=["GET"]),
        Route(base + "/{conversation_id}/items/{item_id}", delete_item, methods=["DELETE"]),
    ]
