"""`POST /v1/responses`: OpenAI's Responses API, served by the chat machinery.

The request is translated into a chat request (server/responses_input.py): `instructions` becomes the
system message, and `input` (a string, or a list of items) becomes the conversation. Items: messages (`role` user, assistant,
system or developer; `content` a string or `input_text` / `output_text` parts), `function_call` (a
call the assistant made earlier) and `function_call_output` (its result, as a tool message).
Earlier `reasoning` items are dropped, as chat templates drop earlier reasoning. Function tools
(`{"type": "function", "name", "parameters"}`), `tool_choice`, `parallel_tool_calls`,
`max_output_tokens`, `temperature`, `top_p` and `text.format` (`json_schema`, `json_object`) map to
their chat fields; so do vLLM's sampling extras (`top_k`, `min_p`, `repetition_penalty`, `seed`) and
`priority` and `cache_salt`. `reasoning.effort` is passed to the chat template as `reasoning_effort`.

The reply comes back as output items: a `reasoning` item (with a reasoning parser), a `message` with
one `output_text` part, and one `function_call` item per tool call. A reply cut by the token limit is
`incomplete` (`max_output_tokens`). With `top_logprobs` (0 to 20), or `include` naming
`message.output_text.logprobs`, the `output_text` part carries the logprobs of the reply's every token, as chat's
`logprobs.content` does (reasoning and tool-call tokens included; streamed, each `output_text.delta` carries the
tokens since the previous one). Streamed, it is the Responses API's typed events, each with its
`sequence_number`: `response.created`, `response.in_progress`, then per item `output_item.added`,
its deltas (`reasoning_text.delta`, `output_text.delta` inside a content part,
`function_call_arguments.delta`) and its `done` events, and `response.completed` (or
`response.incomplete`) with the whole response.

Responses are stored (`store`, true by default as in OpenAI's API; in memory, the newest
`responses_store_capacity`): `previous_response_id` continues the stored conversation (its turns and reply
come before `input`; its `instructions` are not inherited), `GET /v1/responses/{id}` returns a stored
response and `DELETE` forgets it.

`GET /v1/responses/{id}/input_items` lists a stored response's input items (`limit`, `after`, `order`).
`background: true` returns the response in progress once its first token is out and keeps generating: GET
reads it (`in_progress`, then `completed`, `incomplete`, `failed` or `cancelled`), `POST
/v1/responses/{id}/cancel` stops it. A background response is stored and not streamed.

`truncation: "auto"` drops the conversation's oldest turns (whole: a user message and what follows it up to
the next) from the prompt until it fits the context (the stored conversation keeps them); the latest turn is
always kept, and a prompt that does not fit even so is refused as with `truncation: "disabled"`.

`conversation` (server/conversations.py) puts a kept conversation's items before `input`, and the finished
response's input and output items are added to it.

`max_tool_calls` caps calls to built-in tools, which this server does not run: it is checked and repeated in
the response, and never binds (function calls are the client's to run).

Refused by name: `prompt` (stored prompt templates), tools other than functions, and content other than text.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Mapping
from typing import Any

from jaxserve.outputs import RequestOutput
from server.chat_replies import ChatReplies
from server.conversations import Conversation, ConversationStore, conversation_of, history_of
from server.errors import ApiError, error_body
from server.generation import Generation, Job
from server.protocol import ChatRequest
from server.reasoning import constrained_throughout, request_parser
from server.response_store import ResponseStore, StoredResponse
from server.responses import ChoiceCursor, TokenText, chat_logprobs
from server.responses_input import chat_body, input_messages, listed_input_items
from server.state import ServerState

logger = logging.getLogger("jaxserve.server")


class ResponsesFormatter:
    """Builds the response object and the stream events of one `/v1/responses` request."""

    done = None  # a Responses stream ends with its last event

    def __init__(self, state: ServerState, req: ChatRequest, kind: str, request_id: str, jobs: list[Job],
                 body: Mapping[str, Any], history: tuple[dict[str, Any], ...], conversation: Conversation | None):
        self.req, self.request_id, self.body = req, request_id, body
        self.conversation = conversation  # extended with this turn once the response has finished
        # Stored when asked (OpenAI's default) and the server keeps any; `history`: the conversation so far.
        keep = body.get("store", True) and state.responses.capacity > 0
        self.store: ResponseStore | None = state.responses if keep else None
        self.history = history
        self.input_items = listed_input_items(body, request_id)
        self.background = bool(body.get("background"))
        self.model = state.model_name
        self.created = int(time.time())
        self.id = f"resp_{request_id}"
        self.tokenizer = state.engine.tokenizer
        self.page_size = getattr(state.engine, "prefix_cache_page_size", None)
        reasoning = request_parser(state.reasoning_parser, req)
        self.replies = ChatReplies(req.tool_choice, state.tool_parser, reasoning,
                                   constrained=constrained_throughout(reasoning, req),
                                   include_reasoning=True, function_tools=req.tools)
        self.cursor = ChoiceCursor()
        self.top_n = req.common.params.logprobs or 0
        self.want_logprobs = req.common.params.logprobs is not None
        self.text_of = TokenText(self.tokenizer)
        self.pending: list[dict[str, Any]] = []  # streamed: the logprobs of tokens no text delta has carried yet
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # the output items streamed so far
        self.open: dict[str, Any] | None = None  # the item still receiving deltas
        self.finish: str | None = None

    # -- the response object -----------------------------------------------------------------------

    def _response(self, status: str, output: list[dict[str, Any]], gen: Generation | None) -> dict[str, Any]:
        b = self.body
        out: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
            "metadata": b.get("metadata") or {}, "model": self.model, "output": output,
            "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "previous_response_id": b.get("previous_response_id"),
            "reasoning": {"effort": (b.get("reasoning") or {}).get("effort"), "summary": None},
            "store": self.store is not None,
            "temperature": b.get("temperature", 1.0), "text": b.get("text") or {"format": {"type": "text"}},
            "tool_choice": b.get("tool_choice", "auto"), "tools": b.get("tools") or [],
            "top_p": b.get("top_p", 1.0), "top_logprobs": b.get("top_logprobs"),
            "max_tool_calls": b.get("max_tool_calls"),
            "truncation": b.get("truncation") or "disabled", "user": b.get("user"), "usage": None,
            "background": self.background,
            "conversation": {"id": self.conversation.id} if self.conversation is not None else None,
        }
        if gen is not None:
            prompt, completion, cached = gen.usage_counts()
            # Reasoning tokens: the reasoning text tokenized again (the parser splits text, not tokens).
            thought = "".join(p["text"] for item in output if item["type"] == "reasoning" for p in item["content"])
            # Written to the prefix cache: the prompt's whole pages it did not read from there.
            written = max(0, prompt // self.page_size * self.page_size - cached) if self.page_size else 0
            out["usage"] = {"input_tokens": prompt,
                            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": written},
                            "output_tokens": completion,
                            "output_tokens_details": {"reasoning_tokens": len(self.tokenizer.encode(thought))
                                                      if thought else 0},
                            "total_tokens": prompt + completion}
        return out

    def _status(self) -> str:
        return "incomplete" if self.finish == "length" else "completed"

    def _finished(self, response: dict[str, Any]) -> dict[str, Any]:
        """`response`, stored first when it is to be: with its conversation, the reply's items read back as
        chat messages."""
        if self.store is not None:
            reply = input_messages({"input": response["output"]}) if response["output"] else []
            self._keep(response, (*self.history, *reply))
        if self.conversation is not None:
            self.conversation.items.extend([*self.input_items, *response["output"]])
        return response

    def _keep(self, response: dict[str, Any], history: tuple[dict[str, Any], ...]) -> None:
        assert self.store is not None
        self.store.put(StoredResponse(response, history, self.input_items))

    # -- background responses --------------------------------------------------------------------

    def start_background(self, gen: Generation) -> dict[str, Any]:
        """Leave `gen` (its first output in) generating in a task and return the response as it stands: in
        progress, stored so that GET reads it, then replaced by the finished one (or cancelled, or failed)."""
        assert self.store is not None, "a background response is stored"
        response = self._response("in_progress", [], None)
        self._keep(response, self.history)
        self.store.running[self.id] = asyncio.create_task(self._run(gen))
        return response

    async def _run(self, gen: Generation) -> None:
        assert self.store is not None
        try:
            await gen.collect()
            self.full(gen)
        except asyncio.CancelledError:  # POST /v1/responses/{id}/cancel
            await gen.close()  # aborted in the engine before the counts are read
            self._keep(self._response("cancelled", [], gen), self.history)
        except Exception as e:  # the engine failed this request: the response says so
            logger.exception("background response %s failed", self.id)
            response = self._response("failed", [], gen)
            response["error"] = {"code": "server_error", "message": f"the engine failed while generating: {e}"}
            self._keep(response, self.history)
        finally:
            await gen.close()
            self.store.running.pop(self.id, None)

    def full(self, gen: Generation) -> dict[str, Any]:
        """The non-streaming response."""
        out = gen.latest[0]
        assert out is not None
        c = out.outputs[0]
        message, self.finish = self.replies.message(c)
        status = self._status()
        items: list[dict[str, Any]] = []
        if message.get("reasoning"):
            items.append(self._reasoning_item(message["reasoning"], "completed"))
        if message.get("content"):
            lps = chat_logprobs(self.text_of, c.token_ids, c.logprobs or [], self.top_n) if self.want_logprobs else []
            items.append(self._message_item(message["content"], status, lps))
        for i, call in enumerate(message.get("tool_calls") or ()):
            items.append(self._call_item(i, call["id"], call["function"]["name"], call["function"]["arguments"],
                                         "completed"))
        return self._finished(self._response(status, items, gen))

    def _reasoning_item(self, text: str, status: str) -> dict[str, Any]:
        return {"type": "reasoning", "id": f"rs_{self.request_id}", "summary": [],
                "content": [{"type": "reasoning_text", "text": text}], "status": status}

    def _message_item(self, text: str, status: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        return {"type": "message", "id": f"msg_{self.request_id}", "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}

    def _call_item(self, i: int, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
        return {"type": "function_call", "id": f"fc_{self.request_id}_{i}", "call_id": call_id, "name": name,
                "arguments": arguments, "status": status}

    # -- the stream --------------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> bytes:
        obj = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()

    def error(self, status: int, message: str, code: str | None = None) -> bytes:
        err = error_body(status, message, code=code)["error"]
        return self._event("error", code=err.get("code"), message=err["message"], param=err.get("param"))

    def _add(self, item: dict[str, Any], part: dict[str, Any] | None) -> list[bytes]:
        """Open a new output item (closing the one before), with its first content part."""
        events = self._close()
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        events.append(self._event("response.output_item.added", output_index=index, item=item))
        if part is not None:
            item["content"] = [dict(part)]
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                      content_index=0, part=part))
        return events

    def _close(self) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.items) - 1
        events = []
        item["status"] = self._status() if item["type"] == "message" else "completed"
        if item["type"] == "function_call":
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, arguments=item["arguments"]))
        else:
            part = item["content"][0]
            kind = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
            extra = {"logprobs": part["logprobs"]} if item["type"] == "message" else {}
            events.append(self._event(kind, item_id=item["id"], output_index=index, content_index=0,
                                      text=part["text"], **extra))
            events.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=part))
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        return events

    def _text(self, kind: str, text: str) -> list[bytes]:
        """A reasoning or answer delta, in its item (opened first if another is open)."""
        events: list[bytes] = []
        if self.open is None or self.open["type"] != kind:
            if kind == "reasoning":
                item = self._reasoning_item("", "in_progress")
                part = {"type": "reasoning_text", "text": ""}
            else:
                item = self._message_item("", "in_progress")
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"] = []
            events += self._add(item, part)
        item = self.open
        assert item is not None
        item["content"][0]["text"] += text
        extra = {}
        if kind == "message":
            extra["logprobs"], self.pending = self.pending, []
            item["content"][0]["logprobs"] += extra["logprobs"]
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        events.append(self._event(name, item_id=item["id"], output_index=len(self.items) - 1, content_index=0,
                                  delta=text, **extra))
        return events

    def _call(self, call: Mapping[str, Any]) -> list[bytes]:
        """A tool call, whole or (a forced call streaming its arguments) a piece of one."""
        events: list[bytes] = []
        fn = call.get("function") or {}
        if call.get("id"):  # a new call
            n = sum(1 for item in self.items if item["type"] == "function_call")
            events += self._add(self._call_item(n, call["id"], fn.get("name", ""), "", "in_progress"), None)
        item = self.open
        assert item is not None and item["type"] == "function_call"
        piece = fn.get("arguments") or ""
        if piece:
            item["arguments"] += piece
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=len(self.items) - 1, delta=piece))
        return events

    def deltas(self, job: int, out: RequestOutput, gen: Generation) -> list[bytes]:
        """The events for what `out` added to the reply."""
        events = []
        if self.seq == 0:
            created = self._response("in_progress", [], None)
            events += [self._event("response.created", response=created),
                       self._event("response.in_progress", response=created)]
        c = out.outputs[0]
        d = self.cursor.advance(c)
        if d is None:
            return events
        if self.want_logprobs:
            self.pending += chat_logprobs(self.text_of, d.token_ids, d.logprobs, self.top_n)
        delta, finish = self.replies.delta(self.cursor, c, d)
        if delta.get("reasoning"):
            events += self._text("reasoning", delta["reasoning"])
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for call in delta.get("tool_calls") or ():
            events += self._call(call)
        if finish is not None:
            self.finish = finish
        return events

    def closing(self, gen: Generation) -> list[bytes]:
        """The open item's `done` events and the finished response (whose text part has the logprobs of
        the tokens after its last delta too)."""
        message = next((item for item in reversed(self.items) if item["type"] == "message"), None)
        if message is not None:
            message["content"][0]["logprobs"] += self.pending
        self.pending = []
        events = self._close()
        status = self._status()
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return [*events, self._event(kind, response=self._finished(self._response(status, self.items, gen)))]


def responses_api(store: ResponseStore, conversations: ConversationStore) -> dict[str, Any]:
    """`handle_generate`'s arguments that serve one `/v1/responses` request: its translation into a chat
    request (after the stored response or the conversation it continues), and its formatter (which keeps the
    original body, for the fields the response repeats, and the conversation, to store with the reply)."""
    translated: dict[str, Any] = {}

    def translate(body: Any) -> dict[str, Any]:
        history: tuple[dict[str, Any], ...] = ()
        conversation = conversation_of(conversations, body) if isinstance(body, Mapping) else None
        if conversation is not None:
            history = history_of(conversation)
        if isinstance(body, Mapping) and body.get("background") and store.capacity == 0:
            raise ApiError(400, "a background response is read back by id, and this server stores none "
                                "(--responses-store-capacity 0)", param="background", code="unsupported_parameter")
        previous = body.get("previous_response_id") if isinstance(body, Mapping) else None
        if previous is not None:
            stored = store.get(previous) if isinstance(previous, str) else None
            if stored is None:
                raise ApiError(404, f"no stored response with id {previous!r} (responses are kept in memory, the "
                                    f"newest {store.capacity})", param="previous_response_id", code="not_found")
            if stored.response.get("status") == "in_progress":
                raise ApiError(400, f"response {previous!r} is still in progress (a background response); continue "
                                    "from it once GET /v1/responses/{id} shows it completed",
                               param="previous_response_id", code="invalid_value")
            history = stored.history
        chat = chat_body(body, history)
        translated["body"] = body
        translated["history"] = (*history, *input_messages(body))
        translated["conversation"] = conversation
        return chat

    def formatter(*args: Any) -> ResponsesFormatter:
        return ResponsesFormatter(*args, body=translated["body"], history=translated["history"],
                                  conversation=translated["conversation"])

    def prepare(req: ChatRequest) -> ChatRequest:
        return dataclasses.replace(req, drop_turns_to_fit=translated["body"].get("truncation") == "auto")

    return {"translate": translate, "formatter": formatter, "prepare": prepare}
