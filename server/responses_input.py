"""The `/v1/responses` request as the chat request that computes it (server/openai_responses.py serves it).

`instructions` becomes the system message, `input` (a string, or a list of items) the conversation after the
stored one it continues: messages, `function_call` items (an assistant turn's tool calls) and
`function_call_output` items (tool messages); earlier `reasoning` items are dropped. Tools, `tool_choice`,
`text.format` and the sampling fields map to their chat fields; what the server does not serve is refused by
name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from server.errors import ApiError, bad_field

_SAME = ("model", "temperature", "top_p", "parallel_tool_calls", "top_k", "min_p", "repetition_penalty", "seed",
         "priority", "cache_salt", "stream")
_KNOWN = {*_SAME, "input", "instructions", "max_output_tokens", "tools", "tool_choice", "text", "reasoning", "store",
          "metadata", "user", "truncation", "include", "service_tier", "safety_identifier", "prompt_cache_key",
          "previous_response_id", "background", "top_logprobs", "conversation", "max_tool_calls"}
_REFUSED = {
    "prompt": "stored prompt templates are not supported",
}


def _text(part: Any, where: str) -> str:
    if not isinstance(part, Mapping) or part.get("type") not in ("input_text", "output_text", "text"):
        kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
        raise bad_field(where, f"{where} has type {kind!r}; text and input_image content are supported",
                        "unsupported_content")
    if not isinstance(part.get("text"), str):
        raise bad_field(f"{where}.text", f"{where}.text must be a string", "invalid_type")
    return part["text"]


def _content(parts: list[Any], where: str) -> str | list[dict[str, Any]]:
    """A message's content parts: their text joined, or (with `input_image` parts) chat content parts."""
    out: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        if isinstance(part, Mapping) and part.get("type") == "input_image":
            if not isinstance(part.get("image_url"), str):
                raise bad_field(f"{where}[{j}].image_url", f"{where}[{j}].image_url must be an image URL (a data: or "
                                                           "http(s) URL; file_id is not supported)", "invalid_type")
            out.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            out.append({"type": "text", "text": _text(part, f"{where}[{j}]")})
    if all(p["type"] == "text" for p in out):
        return "".join(p["text"] for p in out)
    return out


def _instructions(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """`instructions` as the conversation's system message (none without them)."""
    instructions = body.get("instructions")
    if instructions is None:
        return []
    if not isinstance(instructions, str):
        raise bad_field("instructions", "'instructions' must be a string", "invalid_type")
    return [{"role": "system", "content": instructions}]


def input_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The chat conversation of `input` (a response's output items read as input items give its reply)."""
    messages: list[dict[str, Any]] = []
    items = body.get("input")
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_field("input", "'input' must be a string or a non-empty list of input items",
                        "missing_required_parameter" if items is None else "invalid_type")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise bad_field(where, f"{where} must be an input item object", "invalid_type")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_field(f"{where}.role", f"{where}.role must be user, assistant, system or developer")
            content = item.get("content")
            if isinstance(content, list):
                content = _content(content, f"{where}.content")
            elif not isinstance(content, str):
                raise bad_field(f"{where}.content", f"{where}.content must be a string or a list of content parts",
                                "invalid_type")
            messages.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise bad_field(f"{where}.{key}", f"{where}.{key} must be a string", "invalid_type")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)  # calls made together go in one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list):
                output = "".join(_text(p, f"{where}.output[{j}]") for j, p in enumerate(output))
            if not isinstance(item.get("call_id"), str) or not isinstance(output, str):
                raise bad_field(where, f"{where} needs a string call_id and output", "invalid_type")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        elif kind != "reasoning":  # earlier reasoning is dropped, as chat templates drop it
            raise bad_field(f"{where}.type", f"{where} has type {kind!r}; input items are messages, function_call, "
                                             "function_call_output and reasoning", "unsupported_content")
    return messages


def listed_input_items(body: Mapping[str, Any], request_id: str) -> tuple[dict[str, Any], ...]:
    """`input` (already checked by `input_messages`) as the items `GET /v1/responses/{id}/input_items` lists,
    each with an id (its own, or one made from the request's)."""
    items = body["input"]
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    listed = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            part = "output_text" if item["role"] == "assistant" else "input_text"
            content = item["content"]
            given = [{"type": "text", "text": content}] if isinstance(content, str) else content
            parts = [dict(p) if p.get("type") == "input_image" else
                     {"type": part, "text": p["text"], **({"annotations": []} if part == "output_text" else {})}
                     for p in given]
            out = {"type": "message", "role": item["role"], "content": parts, "status": "completed"}
        elif kind == "reasoning":
            out = {"type": "reasoning", "summary": item.get("summary") or [], "content": item.get("content") or []}
        else:
            out = {k: item[k] for k in ("type", "call_id", "name", "arguments", "output") if k in item}
            out["status"] = "completed"
        prefix = {"message": "msg", "reasoning": "rs", "function_call": "fc"}.get(kind, "fco")
        listed.append({"id": item.get("id") or f"{prefix}_{request_id}_{i}", **out})
    return tuple(listed)


def _tools(body: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise bad_field("tools", "'tools' must be a list", "invalid_type")
        chat_tools = []
        for i, t in enumerate(tools):
            if not isinstance(t, Mapping) or t.get("type") != "function":
                kind = t.get("type") if isinstance(t, Mapping) else None
                raise bad_field(f"tools[{i}].type", f"tools[{i}] has type {kind!r}; only function tools are "
                                                    "supported", "unsupported_parameter")
            fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
            chat_tools.append({"type": "function", "function": fn})
        out["tools"] = chat_tools
    choice = body.get("tool_choice")
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice is not None:
        out["tool_choice"] = choice
    return out


def _format(body: Mapping[str, Any]) -> dict[str, Any]:
    text = body.get("text")
    if text is None:
        return {}
    fmt = text.get("format") if isinstance(text, Mapping) else None
    if fmt is None:
        return {}
    if not isinstance(fmt, Mapping):
        raise bad_field("text.format", "'text.format' must be an object", "invalid_type")
    kind = fmt.get("type")
    if kind == "json_schema":
        return {"response_format": {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "response"), "schema": fmt.get("schema"), "strict": fmt.get("strict")}}}
    if kind in ("json_object", "text"):
        return {"response_format": {"type": kind}}
    raise bad_field("text.format.type", f"'text.format.type' must be text, json_schema or json_object, got {kind!r}")


def drop_oldest_turns(messages: list[dict[str, Any]], fits: Callable[[list[dict[str, Any]]], bool]
                      ) -> list[dict[str, Any]]:
    """`messages` (which do not fit) without the fewest oldest turns (a user message and the messages after
    it, up to the next user message) that make `fits` true; the leading system messages and the latest turn
    always stay. The last try (only the latest turn) is returned when nothing fits, for the caller's refusal
    to name its length."""
    head = 0
    while head < len(messages) and messages[head].get("role") in ("system", "developer"):
        head += 1
    # Cut points: drop messages[head:cut]. The first turn may begin before any user message (an assistant
    # message that a continued conversation starts with): the first cut drops it too.
    cuts = [i for i in range(head + 1, len(messages)) if messages[i].get("role") == "user"]
    if not cuts:
        return messages
    lo, hi = 0, len(cuts) - 1  # the smallest cut index that fits (the prompt only shrinks as turns go)
    while lo < hi:
        mid = (lo + hi) // 2
        if fits([*messages[:head], *messages[cuts[mid]:]]):
            hi = mid
        else:
            lo = mid + 1
    return [*messages[:head], *messages[cuts[lo]:]]


OUTPUT_LOGPROBS = "message.output_text.logprobs"


def _logprobs(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat fields that return the reply's logprobs: asked for by `include` naming them, or by
    `top_logprobs` (0 to 20 alternatives per token)."""
    include = body.get("include")
    if include is not None and (not isinstance(include, list) or not all(isinstance(x, str) for x in include)):
        raise bad_field("include", "'include' must be a list of strings", "invalid_type")
    top = body.get("top_logprobs")
    if top is None and OUTPUT_LOGPROBS not in (include or ()):
        return {}
    return {"logprobs": True, "top_logprobs": 0 if top is None else top}


def chat_body(body: Any, history: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    """A Responses API body as the chat completions body that computes it; `history`: the stored conversation
    `previous_response_id` continues."""
    if not isinstance(body, Mapping):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_type")
    for name, why in _REFUSED.items():
        if body.get(name) not in (None, False):
            raise bad_field(name, f"'{name}': {why}", "unsupported_parameter")
    unknown = sorted(set(body) - _KNOWN - set(_REFUSED))
    if unknown:
        raise bad_field(unknown[0], f"unknown field {unknown[0]!r} for /v1/responses", "unknown_parameter")
    if body.get("background"):
        if body.get("stream"):
            raise bad_field("stream", "a background response is not streamed here: poll GET /v1/responses/{id}",
                            "unsupported_parameter")
        if body.get("store") is False:
            raise bad_field("store", "a background response must be stored ('store': true): it is read back by id",
                            "invalid_value")
    limit = body.get("max_tool_calls")  # a cap on built-in tools' calls: this server runs none, so it never binds
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise bad_field("max_tool_calls", f"'max_tool_calls' must be a positive integer, got {limit!r}",
                        "invalid_value")
    if body.get("truncation", "disabled") not in ("disabled", "auto", None):
        raise bad_field("truncation", f"'truncation' must be 'disabled' or 'auto', got {body['truncation']!r}",
                        "invalid_value")
    chat: dict[str, Any] = {k: body[k] for k in _SAME if k in body}
    chat["messages"] = [*_instructions(body), *history, *input_messages(body)]
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    effort = body.get("reasoning", {}).get("effort") if isinstance(body.get("reasoning"), Mapping) else None
    if effort is not None:
        chat["chat_template_kwargs"] = {"reasoning_effort": effort}
    return {**chat, **_tools(body), **_format(body), **_logprobs(body)}
