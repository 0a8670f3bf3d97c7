"""Reading GLM-4.5's tool calls as their text grows, so that a call's string arguments stream while the model
writes them.

The format, in a `<tool_call>` region: the function's name, then `<arg_key>KEY</arg_key>` and
`<arg_value>VALUE</arg_value>` per argument, whitespace between. GLM-4.5's chat template writes a string value as
it is and any other as JSON, so a value is typed by the tool's parameter schema when it has one, else by what
its text spells (`tool_parsers._glm_value`).

`GlmCallReader` gives out a call once its first value begins (or, with no arguments, at the region's end): its
name, then its arguments as the JSON object `json.dumps` writes. A value the schema says is a string goes out as
it is written; any other once it ends. What follows a call that is not this format is left over for content
(server/tool_stream.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from jaxserve.detokenizer import partial_stop_suffix
from server.json_calls import CallDelta, Reader, write_json_chars
from server.xml_calls import schema_type

KEY, END_KEY, VALUE, END_VALUE = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
_NAME_CHAR = re.compile(r"[\w.:-]")
_SPACE = " \t\n\r"


class GlmCallReader(Reader):
    """GLM-4.5's call in one region; `schemas` maps each tool's name to its parameters' JSON schema, `value_of`
    types a finished value by its schema."""

    def __init__(self, schemas: Mapping[str, Any], value_of: Callable[[str, Any], Any]):
        super().__init__()
        self.schemas, self.value_of = schemas, value_of
        self.state = "name"  # name | body | key | gap | value
        self.pending = ""  # the name, marker or key being read
        self.name = ""
        self.props: Mapping[str, Any] = {}
        self.open = False  # the call has gone out and is not closed
        self.params = 0
        self.key = ""
        self.streams = False  # the value being read goes out as it comes (a string)
        self.value = ""  # the value's text not yet given out (all of it, unless it streams)

    def finish(self) -> list[CallDelta]:
        out: list[CallDelta] = []
        if self.state == "value":  # the region's end ends the value
            self._end_value(self.value, out)
        if self.state == "name" and self.pending and not self.failed:
            self._named(self.pending)
        if self.open:  # closed where it stands, even when what followed was not this format
            self._arguments("}", out)
            self.open = False
        elif not self.failed and self.state == "body" and not self.pending:  # a call without arguments
            out.append(CallDelta(self.calls, self.name, "{}"))
            self.calls += 1
        self.clean = not self.pending and not self.failed and self.state == "body"
        return out

    def _named(self, name: str) -> None:
        self.name, self.pending = name, ""
        props = (self.schemas.get(name) or {}).get("properties")
        self.props, self.state = props if isinstance(props, Mapping) else {}, "body"

    def _step(self, ch: str, at: int, out: list[CallDelta]) -> None:
        if self.state == "value":
            self._value_char(ch, out)
        elif self.state == "name":  # whitespace, then the name; it ends at whitespace or at the first tag
            if _NAME_CHAR.match(ch):
                self.pending += ch
            elif ch in _SPACE:
                if self.pending:
                    self._named(self.pending)
            elif ch == "<" and self.pending:
                self._named(self.pending)
                self.pending, self.clean = "<", False
            else:
                raise ValueError("text that is not a function's name")
        elif self.state == "key":
            self.pending += ch
            if self.pending.endswith(END_KEY):
                self.key, self.state, self.pending = self.pending[:-len(END_KEY)].strip(), "gap", ""
        elif not self.pending and ch in _SPACE:
            pass
        else:  # a tag: an argument's key opening (between arguments), or its value opening (after its key)
            self.clean = False
            self.pending += ch
            tag = KEY if self.state == "body" else VALUE
            if not tag.startswith(self.pending):
                raise ValueError("text that is not this format")
            if self.pending == KEY:
                self.state, self.pending = "key", ""
            elif self.pending == VALUE:
                self._begin_value(out)
        if self.open and self.state in ("body", "value") and not self.pending:
            self.used = at + 1  # what the calls account for: all but a tag or key being read

    def _begin_value(self, out: list[CallDelta]) -> None:
        if not self.open:  # the call goes out with its first value
            out.append(CallDelta(self.calls, self.name, "{"))
            self.calls, self.open = self.calls + 1, True
        self.streams = schema_type(self.props.get(self.key)) == "string"
        self._arguments((", " if self.params else "") + json.dumps(self.key, ensure_ascii=False) + ": "
                        + ('"' if self.streams else ""), out)
        self.state, self.pending, self.value = "value", "", ""
        self.params += 1

    def _value_char(self, ch: str, out: list[CallDelta]) -> None:
        self.value += ch
        if self.value.endswith(END_VALUE):
            self._end_value(self.value[:-len(END_VALUE)], out)
            self.clean = True
        elif self.streams:  # give out all but what may be the end tag
            safe = self.value[:len(self.value) - partial_stop_suffix(self.value, (END_VALUE,))]
            self._arguments(write_json_chars(safe), out)
            self.value = self.value[len(safe):]

    def _end_value(self, rest: str, out: list[CallDelta]) -> None:
        if self.streams:
            self._arguments(write_json_chars(rest) + '"', out)
        else:
            self._arguments(json.dumps(self.value_of(rest, self.props.get(self.key)), ensure_ascii=False), out)
        self.state, self.value = "body", ""
