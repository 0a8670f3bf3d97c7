"""Gemma 4's tool calls (the `gemma4` tool-call parser, vLLM's name): between `<|tool_call>` and `<tool_call|>`,
`call:NAME{KEY:VALUE,...}`, one call or several one after another. Keys are bare; a string value is written
between `<|"|>` markers (a JSON-quoted one is taken too), an object as `{KEY:VALUE,...}`, a list as `[VALUE,...]`,
any other value bare (a number, true, false, null; bare text where the tool's schema says string, or where it
spells no other value). The arguments go out as the JSON object `json.dumps` writes."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from server.tool_stream import ParsedCall
from server.xml_calls import schema_type

QUOTE = '<|"|>'
_NAME = re.compile(r"\s*call:([\w.:-]+)\{")
_KEY = re.compile(r"\s*([\w.-]+)\s*:")
_NUMBER = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?([eE][-+]?\d+)?")


class _Malformed(ValueError):
    pass


def gemma4_calls(body: str, schemas: Mapping[str, Any]) -> list[ParsedCall] | None:
    """The calls in one region's `body` (what follows `<|tool_call>`, without `<tool_call|>`); None when it is not
    this format throughout."""
    calls, at = [], 0
    try:
        while body[at:].strip():
            m = _NAME.match(body, at)
            if m is None:
                return None
            name = m.group(1)
            props = (schemas.get(name) or {}).get("properties")
            args, at = _object(body, m.end(), props if isinstance(props, Mapping) else {})
            calls.append(ParsedCall(name, json.dumps(args, ensure_ascii=False)))
    except _Malformed:
        return None
    return calls or None


def _object(text: str, at: int, props: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
    """The object whose `{` is just before `at`, and where it ends (past its `}`)."""
    out: dict[str, Any] = {}
    at = _skip(text, at)
    if text.startswith("}", at):
        return out, at + 1
    while True:
        m = _KEY.match(text, at)
        if m is None:
            raise _Malformed(at)
        key = m.group(1)
        out[key], at = _value(text, _skip(text, m.end()), props.get(key) if isinstance(props, Mapping) else None)
        at = _skip(text, at)
        if text.startswith(",", at):
            at += 1
        elif text.startswith("}", at):
            return out, at + 1
        else:
            raise _Malformed(at)


def _list(text: str, at: int, schema: Any) -> tuple[list[Any], int]:
    items = schema.get("items") if isinstance(schema, Mapping) else None
    out: list[Any] = []
    at = _skip(text, at)
    if text.startswith("]", at):
        return out, at + 1
    while True:
        value, at = _value(text, at, items)
        out.append(value)
        at = _skip(text, at)
        if text.startswith(",", at):
            at = _skip(text, at + 1)
        elif text.startswith("]", at):
            return out, at + 1
        else:
            raise _Malformed(at)


def _value(text: str, at: int, schema: Any) -> tuple[Any, int]:
    if text.startswith(QUOTE, at):
        end = text.find(QUOTE, at + len(QUOTE))
        if end < 0:
            raise _Malformed(at)
        return text[at + len(QUOTE):end], end + len(QUOTE)
    if text.startswith('"', at):
        try:
            return json.JSONDecoder().raw_decode(text, at)
        except ValueError as e:
            raise _Malformed(at) from e
    if text.startswith("{", at):
        props = schema.get("properties") if isinstance(schema, Mapping) else None
        return _object(text, at + 1, props if isinstance(props, Mapping) else {})
    if text.startswith("[", at):
        return _list(text, at + 1, schema)
    end = at
    while end < len(text) and text[end] not in ",}]":
        end += 1
    raw = text[at:end].strip()
    if not raw:
        raise _Malformed(at)
    return _bare(raw, schema_type(schema)), end


def _bare(raw: str, kind: str | None) -> Any:
    """A bare value: text where the schema says string, else the number, boolean or null it spells, else text."""
    if kind == "string":
        return raw
    if raw in ("true", "false"):
        return raw == "true"
    if raw in ("null", "None"):
        return None
    if _NUMBER.fullmatch(raw):
        return float(raw) if any(c in raw for c in ".eE") else int(raw)
    return raw


def _skip(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at
