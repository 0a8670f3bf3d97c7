"""What every tool-call format shares (server/tool_parsers.py): a parser's regions and the JSON helpers."""

from __future__ import annotations

import abc
import json
from typing import Any, ClassVar

from server.json_calls import Reader, whole_call
from server.tool_stream import ParsedCall, Schemas, ToolCallStream, join_calls


def call_of(obj: Any) -> ParsedCall | None:
    """A call from a decoded `{"name": ..., "arguments": {...}}` object; None if it is not one."""
    call = whole_call(obj)
    return None if call is None else ParsedCall(*call)


def calls_of(values: list[Any]) -> list[ParsedCall] | None:
    calls = [call_of(v) for v in values]
    return None if not calls or any(c is None for c in calls) else calls  # type: ignore[return-value]


def json_values(text: str, separators: str = "") -> list[Any] | None:
    """The JSON values `text` holds one after another (whitespace and `separators` between them)."""
    decoder = json.JSONDecoder()
    values, at, text = [], 0, text.strip()
    while at < len(text):
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        values.append(value)
        while at < len(text) and (text[at].isspace() or text[at] in separators):
            at += 1
    return values


def json_calls(text: str) -> list[ParsedCall] | None:
    """The calls of JSON call objects one after another, or of one JSON list of them."""
    values = json_values(text)
    if values is not None and len(values) == 1 and isinstance(values[0], list):
        values = values[0]
    return None if values is None else calls_of(values)


class ToolParser(abc.ABC):
    """A model's tool-call format. A call region opens at one of `openers`, anywhere in the reply (or,
    with `leading`, only at its start, where the opener is part of the region); it closes at `closer`,
    or runs to the end of the reply when `closer` is empty."""

    name: ClassVar[str]
    openers: ClassVar[tuple[str, ...]]
    closer: ClassVar[str] = ""
    leading: ClassVar[bool] = False
    # The format's markers are special tokens, which the reply must keep to be parsed.
    keeps_special_tokens: ClassVar[bool] = False

    @abc.abstractmethod
    def parse_region(self, opener: str, body: str, schemas: Schemas) -> list[ParsedCall] | None:
        """The calls in one region (`body` is what follows `opener`); None if it holds no valid call.
        `schemas` maps each tool's name to its parameters' JSON schema, for formats that write values
        untyped."""

    def reader(self, opener: str, head: str, schemas: Schemas) -> Reader | None:
        """A reader of a region's calls as its text grows (`head` the body's first character besides
        whitespace; `schemas` as for `parse_region`), or None when the region is held until it is whole."""
        return None

    def stream(self, schemas: Schemas | None = None) -> ToolCallStream:
        return ToolCallStream(self, schemas)

    def parse(self, text: str, schemas: Schemas | None = None) -> tuple[str, list[ParsedCall]]:
        """A whole reply's content and calls."""
        s = self.stream(schemas)
        content, deltas = s.feed(text)
        more, last = s.finish()
        return content + more, join_calls(deltas + last)
