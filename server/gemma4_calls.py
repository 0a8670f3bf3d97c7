"""Gemma 4's tool calls (the `gemma4` tool-call parser, vLLM's name): between `<|tool_call>` and `<tool_call|>`,
`call:NAME{KEY:VALUE,...}`, one call or several one after another. Keys are bare; a string value is written
between `<|"|>` markers (a JSON-quoted one is taken too), an object as `{KEY:VALUE,...}`, a list as `[VALUE,...]`,
any other value bare (a number, true, false, null; bare text where the tool's schema says string, or where it
spells no other value). The arguments go out as the JSON object `json.dumps` writes.

`Gemma4CallReader` reads the calls as their text grows: a call goes out once its `{` is written, then its
arguments piece by piece: keys and brackets as they come, a `<|"|>` string character by character, a JSON-quoted
string as `server.json_calls.JsonValue` gives it, a bare value once it ends (its type known then). A call cut short
is closed where it stands when it stops between values; text that stops being this format is left over for content
(server/tool_stream.py)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from jaxserve.detokenizer import partial_stop_suffix
from server.json_calls import CallDelta, JsonValue, Reader, write_json_chars
from server.tool_stream import ParsedCall, join_calls
from server.xml_calls import schema_type

QUOTE = '<|"|>'
_NUMBER = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?([eE][-+]?\d+)?")
_HEAD = re.compile(r"call:([\w.:-]+)\{")  # a call's start, once whole
_HEAD_PART = re.compile(r"c(a(l(l(:[\w.:-]*)?)?)?)?")  # ... and as it grows
_KEY_CHAR = re.compile(r"[\w.-]")


def gemma4_calls(body: str, schemas: Mapping[str, Any]) -> list[ParsedCall] | None:
    """The calls in one region's `body` (what follows `<|tool_call>`, without `<tool_call|>`), read as a stream reads
    them; None when it is not this format throughout."""
    reader = Gemma4CallReader(schemas)
    deltas = reader.feed(body) + reader.finish()
    return join_calls(deltas) if reader.calls and not reader.leftover() else None


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


def _props(schema: Any) -> Mapping[str, Any]:
    props = schema.get("properties") if isinstance(schema, Mapping) else None
    return props if isinstance(props, Mapping) else {}


class Gemma4CallReader(Reader):
    """Gemma 4's calls in one region, read as they grow (see the module docstring); `schemas` maps each tool's name
    to its parameters' JSON schema, which types bare values."""

    def __init__(self, schemas: Mapping[str, Any]):
        super().__init__()
        self.schemas = schemas
        self.state = "call"  # call | key | value | quoted | json | bare | after
        self.pending = ""  # a call's head, a key or a string marker being read
        self.spaced = False  # whitespace followed the key being read
        self.stack: list[list[Any]] = []  # the open objects and lists: [kind "o" or "a", schema, items so far]
        self.schema: Any = None  # the schema of the value being read
        self.raw = ""  # the bare value, or the string's text not yet given out
        self.json: JsonValue | None = None

    def finish(self) -> list[CallDelta]:
        out: list[CallDelta] = []
        if not self.failed and self.state in ("quoted", "bare"):  # the region's end ends the value
            self._end_value(out)
        if not self.failed and self.stack and not self.pending and (
                self.state in ("after", "key") or self.state == "value" and self.stack[-1][0] == "a"):
            while self.stack:  # closed where it stands: between values
                self._arguments("}" if self.stack.pop()[0] == "o" else "]", out)
            self.state = "call"
        self.clean = self.state == "call" and not self.pending
        return out

    def _step(self, ch: str, at: int, out: list[CallDelta]) -> None:
        closed = self._read(ch, out)
        if self.stack or closed:
            self.used = at + 1 - len(self.pending) - len(self.raw)

    def _read(self, ch: str, out: list[CallDelta]) -> bool:
        """Read `ch`; True where it closed a call."""
        state, space = self.state, ch.isspace()
        if state == "quoted":
            self.raw += ch
            if self.raw.endswith(QUOTE):
                self.raw = self.raw[:-len(QUOTE)]
                self._end_value(out)
            else:  # all but what may be the closing marker
                safe = self.raw[:len(self.raw) - partial_stop_suffix(self.raw, (QUOTE,))]
                self._arguments(write_json_chars(safe), out)
                self.raw = self.raw[len(safe):]
        elif state == "json":
            piece, _ = self.json.feed(ch)
            self._arguments(piece, out)
            if self.json.done:
                self.state = "after"
        elif state == "bare":
            if ch not in ",}]":
                self.raw += ch
                return False
            self._end_value(out)
            return self._read(ch, out)
        elif space and not self.pending:
            pass
        elif state == "call":
            self.clean, self.pending = False, self.pending + ch
            head = _HEAD.fullmatch(self.pending)
            if head is not None:
                out.append(CallDelta(self.calls, head.group(1), "{"))
                self.calls += 1
                self._open("o", (self.schemas.get(head.group(1)) or {}), out)
            elif not _HEAD_PART.fullmatch(self.pending):
                raise ValueError("text that is not a call")
        elif state == "key":
            return self._key(ch, space, out)
        elif state == "value":
            self._value(ch, out)
        elif ch == ",":  # "after" a value
            self.state = "key" if self.stack[-1][0] == "o" else "value"
        elif ch == ("}" if self.stack[-1][0] == "o" else "]"):
            return self._close(out)
        else:
            raise ValueError("text that is not this format")
        return False

    def _key(self, ch: str, space: bool, out: list[CallDelta]) -> bool:
        frame = self.stack[-1]
        if ch == "}" and not self.pending and not frame[2]:
            return self._close(out)
        if space:
            self.spaced = True
        elif ch == ":" and self.pending:
            self._arguments((", " if frame[2] else "") + json.dumps(self.pending, ensure_ascii=False) + ": ", out)
            frame[2] += 1
            self.schema, self.state, self.pending, self.spaced = _props(frame[1]).get(self.pending), "value", "", False
        elif _KEY_CHAR.match(ch) and not self.spaced:
            self.pending += ch
        else:
            raise ValueError("text that is not a key")
        return False

    def _value(self, ch: str, out: list[CallDelta]) -> None:
        frame = self.stack[-1]
        if not self.pending:
            if frame[0] == "a" and ch == "]" and not frame[2]:
                self._close(out)
                return
            if frame[0] == "a":
                self._arguments(", " if frame[2] else "", out)
                frame[2] += 1
                self.schema = frame[1].get("items") if isinstance(frame[1], Mapping) else None
        if ch == "<" or self.pending:
            self.pending += ch
            if self.pending == QUOTE:
                self._arguments('"', out)
                self.state, self.pending, self.raw = "quoted", "", ""
            elif not QUOTE.startswith(self.pending):  # bare text that begins as the marker does
                text, self.pending, self.state = self.pending, "", "bare"
                for c in text:
                    self._read(c, out)
        elif ch == '"':
            self.json, self.state = JsonValue(), "json"
            self._arguments(self.json.feed(ch)[0], out)
        elif ch in "{[":
            self._open("o" if ch == "{" else "a", self.schema, out)
            self._arguments(ch, out)
        elif ch in ",}]":
            raise ValueError("a missing value")
        else:
            self.state, self.raw = "bare", ch

    def _open(self, kind: str, schema: Any, out: list[CallDelta]) -> None:
        self.stack.append([kind, schema, 0])
        self.state, self.pending = ("key" if kind == "o" else "value"), ""

    def _close(self, out: list[CallDelta]) -> bool:
        self._arguments("}" if self.stack.pop()[0] == "o" else "]", out)
        self.state = "after" if self.stack else "call"
        self.clean = not self.stack
        return not self.stack

    def _end_value(self, out: list[CallDelta]) -> None:
        if self.state == "quoted":
            self._arguments(write_json_chars(self.raw) + '"', out)
        else:
            self._arguments(json.dumps(_bare(self.raw.strip(), schema_type(self.schema)), ensure_ascii=False), out)
        self.state, self.raw = "after", ""
