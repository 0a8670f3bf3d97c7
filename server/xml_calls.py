"""Reading Qwen3-Coder's tool calls as their text grows, so that a call's arguments stream while the model
writes them.

The format: `<function=NAME>` then `<parameter=KEY>VALUE</parameter>` per argument, then `</function>`,
one or more functions in a `<tool_call>` region; a value is bare text (code, a path, JSON) between a newline
after its tag and one before its end, and ends at `</parameter>`, at the next `<parameter=`, at
`</function>` or at the region's end. Values are typed by the tool's parameter schema (`typed`). MiniMax-M2
writes the same with its own tags (`MINIMAX`): `<invoke name="NAME">`, `<parameter name="KEY">`, `</invoke>`.

`XmlCallReader` gives out a call once its first parameter begins (or, with none, once it ends): its name,
then its arguments as the JSON object `json.dumps` writes. A string value (or one without a schema) goes
out as it is written; a value of another type once it ends, as its type makes it. A call left open when
its region ends, or when what follows is not this format, is closed where it stands; the text after it is
left over for content (server/tool_stream.py).
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jaxserve.detokenizer import partial_stop_suffix
from server.json_calls import CallDelta, Reader, write_json_chars

_SPACE = " \t\n\r"


@dataclass(frozen=True)
class Tags:
    """A dialect's tags: a function's and a parameter's opening (their name follows, up to `>`, in quotes where
    `quoted`), and their ends."""

    function: str = "<function="
    end_function: str = "</function>"
    parameter: str = "<parameter="
    end_parameter: str = "</parameter>"
    quoted: bool = False

    @property
    def value_ends(self) -> tuple[str, ...]:
        return self.end_parameter, self.parameter, self.end_function

    def name(self, text: str) -> str:
        """A function's or parameter's name as written between its opening and `>`."""
        text = text.strip()
        return text[:-1] if self.quoted and text.endswith('"') else text


QWEN3_CODER = Tags()
MINIMAX = Tags('<invoke name="', "</invoke>", '<parameter name="', "</parameter>", quoted=True)


def schema_type(schema: Any) -> str | None:
    """The JSON type a parameter's schema names (the first besides null, in a list or an anyOf)."""
    if not isinstance(schema, Mapping):
        return None
    kind = schema.get("type")
    kinds = list(kind) if isinstance(kind, list) else [kind]
    for option in schema.get("anyOf") or schema.get("oneOf") or ():
        kinds.append(option.get("type") if isinstance(option, Mapping) else None)
    return next((k for k in kinds if isinstance(k, str) and k != "null"), None)


def typed(raw: str, schema: Any) -> Any:
    """A parameter's text as the value its schema's type makes of it; the text itself when it is not
    one (or the parameter has no schema), so nothing the model wrote is lost."""
    kind = schema_type(schema)
    text = raw.strip()
    if kind in (None, "string"):
        return raw
    if text == "null":
        return None
    if kind == "boolean" and text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        value = json.loads(text)
    except ValueError:
        try:
            value = ast.literal_eval(text) if kind in ("object", "array") else None
        except (ValueError, SyntaxError):
            value = None
    wanted = {"integer": int, "number": (int, float), "object": dict, "array": list}.get(kind, object)
    if value is None or isinstance(value, bool) or not isinstance(value, wanted):
        return raw
    return value


class XmlCallReader(Reader):
    """Qwen3-Coder's calls in one region (see the module docstring); `schemas` maps each tool's name to
    its parameters' JSON schema."""

    def __init__(self, schemas: Mapping[str, Any], tags: Tags = QWEN3_CODER):
        super().__init__()
        self.schemas = schemas
        self.tags = tags
        self.state = "between"  # between | name | body | key | value
        self.text_of_state = ""  # the marker, name or key being read
        self.name = ""
        self.props: Mapping[str, Any] = {}
        self.open = False  # the function's call has gone out and is not closed
        self.params = 0  # its parameters so far
        self.key = ""
        self.streams = False  # the value being read goes out as it comes (a string)
        self.value = ""  # the value's text not yet given out (all of it, unless it streams)
        self.value_began = False  # its first character was read (a newline there is the format's)

    def finish(self) -> list[CallDelta]:
        out: list[CallDelta] = []
        if self.state == "value":  # the region's end ends the value
            self._end_value(self.value, out)
        pending = self.text_of_state  # a tag, name or key cut short: text, not a call's
        if self.open or self.state == "body" and not pending and not self.failed:
            self._end_function(out)
        self.clean = not pending and not self.failed
        return out

    def _step(self, ch: str, at: int, out: list[CallDelta]) -> None:
        state = self.state
        if state == "value":
            self._value_char(ch, out)
        elif state in ("name", "key"):
            if ch == "\n":
                raise ValueError(f"a newline in a {state}")
            if ch != ">":
                self.text_of_state += ch
            elif state == "name":
                self.name, self.text_of_state = self.tags.name(self.text_of_state), ""
                if not self.name:
                    raise ValueError("a function without a name")
                props = (self.schemas.get(self.name) or {}).get("properties")
                self.state, self.params, self.props = "body", 0, props if isinstance(props, Mapping) else {}
            else:
                self._begin_value(self.tags.name(self.text_of_state), out)
        elif not self.text_of_state and ch in _SPACE:
            pass
        else:  # a marker, between functions or between parameters
            self.clean = False
            self.text_of_state += ch
            tags = self.tags
            markers = (tags.function,) if state == "between" else (tags.parameter, tags.end_function)
            if not any(m.startswith(self.text_of_state) for m in markers):
                raise ValueError("text that is not this format")
            if self.text_of_state == tags.function:
                self.state, self.text_of_state = "name", ""
            elif self.text_of_state == tags.parameter:
                self.state, self.text_of_state = "key", ""
            elif self.text_of_state == tags.end_function:
                self.text_of_state = ""
                self._end_function(out)
        if self.state in ("body", "value") and self.open or self.state == "between" and state != "between":
            if not self.text_of_state:
                self.used = at + 1  # what the calls account for: all but a tag or key being read

    def _begin_value(self, key: str, out: list[CallDelta]) -> None:
        if not self.open:  # the call goes out with its first parameter
            out.append(CallDelta(self.calls, self.name, "{"))
            self.calls, self.open = self.calls + 1, True
        schema = self.props.get(key)
        self.streams = schema_type(schema) in (None, "string")
        self._arguments((", " if self.params else "") + json.dumps(key, ensure_ascii=False) + ": "
                        + ('"' if self.streams else ""), out)
        self.state, self.key, self.text_of_state = "value", key, ""
        self.params += 1
        self.value, self.value_began = "", False

    def _value_char(self, ch: str, out: list[CallDelta]) -> None:
        began, self.value_began = self.value_began, True
        if not began and ch == "\n":
            return  # the newline after the tag
        self.value += ch
        ends = self.tags.value_ends
        end = next((m for m in ends if self.value.endswith(m)), None)
        if end is not None:
            self._end_value(self.value[:-len(end)], out)
            if end == self.tags.parameter:
                self.state = "key"
            elif end == self.tags.end_function:
                self._end_function(out)
            return
        if self.streams:  # give out all but what may be an end tag and the newline before it
            hold = partial_stop_suffix(self.value, ends)
            safe = self.value[:len(self.value) - hold]
            safe = safe[:-1] if safe.endswith("\n") else safe
            self._arguments(write_json_chars(safe), out)
            self.value = self.value[len(safe):]

    def _end_value(self, rest: str, out: list[CallDelta]) -> None:
        rest = rest[:-1] if rest.endswith("\n") else rest  # the newline before the end tag
        if self.streams:
            self._arguments(write_json_chars(rest) + '"', out)
        else:
            self._arguments(json.dumps(typed(rest, self.props.get(self.key)), ensure_ascii=False), out)
        self.state, self.value = "body", ""

    def _end_function(self, out: list[CallDelta]) -> None:
        if self.open:
            self._arguments("}", out)
        else:
            out.append(CallDelta(self.calls, self.name, "{}"))
            self.calls += 1
        self.state, self.open, self.clean = "between", False, True
