"""Reading JSON tool calls as their text grows, so that a call's arguments stream while the model writes them.

`JsonValue` reads one JSON value a piece at a time and writes it out as `json.dumps(json.loads(text),
ensure_ascii=False)` would (", " and ": " between items, strings re-escaped, numbers as Python prints them),
giving out each part as soon as it is settled: a string character by character, a number once it ends. What
it has given out is always the start of what it gives for the whole value, so the pieces can be sent as
they come. (One difference from `json.loads` then `json.dumps`: a key written twice in an object is kept
twice rather than keeping the last.)

`JsonCallReader` reads `{"name": ..., "arguments": {...}}` call objects (one after another, or in one
JSON list) and `NamedArgsReader` Mistral's `name[ARGS]{...}` calls. A call streams once its name is known
and its arguments object has begun; a call written otherwise (its arguments before its name, or as a JSON
string) goes out whole when its object closes. A reader never takes back what it gave out: text after the
point where the region stops being calls is left over (`leftover`), and the tool-call stream gives it out
as content.
"""

from __future__ import annotations

import abc
import json
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

_SPACE = " \t\n\r"
_SCALAR_END = frozenset(_SPACE + ",]}")  # what ends a number or a literal
_UNESCAPE = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_ESCAPE = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}
_HEX = frozenset(string.hexdigits)
ARGS_KEYS = ("arguments", "parameters")  # the keys a call's arguments are written under
_STREAMED = object()  # a call object's arguments member that went out as it came


def _write(c: str) -> str:
    """One character of a string as `json.dumps(..., ensure_ascii=False)` writes it."""
    if c in _ESCAPE:
        return _ESCAPE[c]
    return f"\\u{ord(c):04x}" if c < " " else c


def write_json_chars(text: str) -> str:
    """`text` inside a JSON string, as `json.dumps(..., ensure_ascii=False)` writes it (without the quotes)."""
    return "".join(map(_write, text))


class JsonValue:
    """One JSON value, read as its text grows (see the module docstring). `feed` raises ValueError at
    the first character that cannot continue a JSON value."""

    def __init__(self) -> None:
        self.stack: list[str] = []  # the open containers, "o" (object) or "a" (array)
        self.state: Literal["value", "string", "scalar", "key", "colon", "next", "done"] = "value"
        self.empty = False  # a container has just opened: it may close at once
        self.in_key = False  # the string being read is a key
        self.scalar = ""  # the number or literal being read
        self.escape: str | None = None  # the escape sequence being read, after its backslash
        self.high = ""  # a \u escape of a high surrogate, waiting for its low half

    @property
    def done(self) -> bool:
        return self.state == "done"

    def feed(self, text: str) -> tuple[str, int]:
        """The settled output that `text` adds, and how many of its characters belong to the value (all
        of them, unless the value ends inside `text`)."""
        out: list[str] = []
        i = 0
        while i < len(text) and self.state != "done":
            ch, state = text[i], self.state
            if state == "string":
                out.append(self._string(ch))
            elif state == "scalar":
                if ch not in _SCALAR_END:
                    self.scalar += ch
                else:
                    out.append(self._end_scalar())
                    continue  # the character that ended it is read in the next state
            elif ch in _SPACE:
                pass
            elif state == "value":
                out.append(self._start(ch))
            elif state == "key":
                if ch == '"':
                    self.state, self.in_key, self.empty = "string", True, False
                    out.append('"')
                elif ch == "}" and self.empty:
                    out.append(self._close())
                else:
                    raise ValueError(f"expected a key, not {ch!r}")
            elif state == "colon":
                if ch != ":":
                    raise ValueError(f"expected ':', not {ch!r}")
                self.state = "value"
                out.append(": ")
            else:  # "next": after an item of the open container
                if ch == ",":
                    self.state = "key" if self.stack[-1] == "o" else "value"
                    out.append(", ")
                elif ch == ("}" if self.stack[-1] == "o" else "]"):
                    out.append(self._close())
                else:
                    raise ValueError(f"expected ',' or the container's end, not {ch!r}")
            i += 1
        return "".join(out), i

    def _start(self, ch: str) -> str:
        empty, self.empty = self.empty, False
        if ch == "{" or ch == "[":
            self.stack.append("o" if ch == "{" else "a")
            self.state, self.empty = ("key" if ch == "{" else "value"), True
            return ch
        if ch == "]" and empty:
            return self._close()
        if ch == '"':
            self.state, self.in_key = "string", False
            return '"'
        if ch in "-0123456789tfnNI":
            self.state, self.scalar = "scalar", ch
            return ""
        raise ValueError(f"expected a JSON value, not {ch!r}")

    def _close(self) -> str:
        kind = self.stack.pop()
        self._ended()
        return "}" if kind == "o" else "]"

    def _ended(self) -> None:
        self.state = "next" if self.stack else "done"

    def _end_scalar(self) -> str:
        value = json.loads(self.scalar)  # ValueError unless a number, true, false or null
        self._ended()
        return json.dumps(value)

    def _string(self, ch: str) -> str:
        if self.escape is not None:
            return self._escaped(ch)
        if ch == "\\":
            self.escape = ""
            return ""
        if ch == '"':
            out = self._flush() + '"'
            if self.in_key:
                self.state = "colon"
            else:
                self._ended()
            return out
        if ch < " ":
            raise ValueError(f"control character {ch!r} in a JSON string")
        return self._flush() + _write(ch)

    def _escaped(self, ch: str) -> str:
        assert self.escape is not None
        self.escape += ch
        if self.escape[0] != "u":
            c = _UNESCAPE.get(ch)
            if c is None:
                raise ValueError(f"invalid escape \\{ch}")
            self.escape = None
            return self._flush() + _write(c)
        if len(self.escape) > 1 and ch not in _HEX:
            raise ValueError(f"invalid escape \\{self.escape}")
        if len(self.escape) < 5:
            return ""
        code, self.escape = int(self.escape[1:], 16), None
        if 0xDC00 <= code < 0xE000 and self.high:  # the low half of a pair: one character
            high, self.high = self.high, ""
            return chr(0x10000 + ((ord(high) - 0xD800) << 10) + (code - 0xDC00))
        out = self._flush()
        if 0xD800 <= code < 0xDC00:
            self.high = chr(code)
            return out
        return out + _write(chr(code))

    def _flush(self) -> str:
        """A high surrogate not followed by its low half: written alone, as json.dumps writes it."""
        high, self.high = self.high, ""
        return high


@dataclass(frozen=True)
class CallDelta:
    """A piece of a reply's tool call: `index` its number in the reply, `name` set on its first piece
    only, `arguments` the next piece of its arguments' JSON text."""

    index: int
    name: str | None
    arguments: str


def whole_call(obj: Any) -> tuple[str, str] | None:
    """A call's name and arguments text (as json.dumps writes them) from its decoded object
    `{"name": ..., "arguments" or "parameters": {...}}`; None if it is not a call."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args: Any = next((obj[k] for k in ARGS_KEYS if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return (name, json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None


class Reader(abc.ABC):
    """What the readers share: the text read, how much of it went into calls, the calls given out."""

    def __init__(self) -> None:
        self.text = ""  # everything fed
        self.used = 0  # the length of the start of `text` that the calls given out account for
        self.calls = 0  # calls given out (whole or started)
        self.failed = False
        self.clean = True  # the text read so far ends where the region may end: between calls

    def feed(self, text: str) -> list[CallDelta]:
        """The pieces of calls that `text`, the region's next piece, settles."""
        out: list[CallDelta] = []
        at = len(self.text)
        self.text += text
        for i, ch in enumerate(text):
            if self.failed:
                break
            try:
                self._step(ch, at + i, out)
            except ValueError:
                self.failed = True
        return out

    def finish(self) -> list[CallDelta]:
        """The region's end: the pieces that it settles."""
        return []

    def leftover(self) -> str:
        """At the region's end: the text after its calls when it did not end as calls end (cut short,
        or not calls from some point on), given out as content; "" when it ended cleanly."""
        return "" if self.clean and not self.failed else self.text[self.used:]

    @abc.abstractmethod
    def _step(self, ch: str, at: int, out: list[CallDelta]) -> None:
        """Read one more character of the region (`at` its index in `text`), adding what it settles to `out`;
        ValueError where the region stops being calls."""

    def _start_call(self, name: str, out: list[CallDelta]) -> None:
        out.append(CallDelta(self.calls, name, ""))
        self.calls += 1

    def _arguments(self, piece: str, out: list[CallDelta]) -> None:
        """More of the streaming call's arguments (joined to its last delta in `out`)."""
        if not piece:
            return
        if out and out[-1].index == self.calls - 1:
            out[-1] = CallDelta(out[-1].index, out[-1].name, out[-1].arguments + piece)
        else:
            out.append(CallDelta(self.calls - 1, None, piece))


class JsonCallReader(Reader):
    """JSON call objects one after another, whitespace or one of `separators` between them (`lists`
    False), or one JSON list of them (`lists` True; None takes either)."""

    def __init__(self, lists: bool | None, separators: str = ""):
        super().__init__()
        self.lists, self.separators = lists, separators
        self.state = "top"  # top | list | list_next | after_list | key | key_text | colon | member | next
        self.in_list = False
        self.value = JsonValue()  # the key or member value being read
        self.piece = ""  # its output so far (a member that does not stream)
        self.key = ""
        self.obj: dict[str, Any] = {}  # the call object's members read so far
        self.streaming = False  # the member being read is the call's arguments, going out as they come

    def _step(self, ch: str, at: int, out: list[CallDelta]) -> None:
        state = self.state
        if state in ("key_text", "member"):
            self._value(ch, at, out)
            return
        if ch in _SPACE:
            return
        self.clean = False
        if state == "top" and ch in self.separators and self.calls and not self.in_list:
            self.clean = True
        elif (state == "list" or state == "top" and self.lists is not True and not self.in_list) and ch == "{":
            self.state, self.obj = "key", {}
        elif state == "top" and ch == "[" and self.lists is not False and not self.calls and not self.in_list:
            self.state, self.in_list = "list", True
        elif state == "list_next" and ch in ",]":
            self.state, self.clean = ("list", False) if ch == "," else ("after_list", True)
        elif state == "key" and ch == '"':
            self.state, self.value, self.piece = "key_text", JsonValue(), ""
            self._value(ch, at, out)
        elif state == "colon" and ch == ":":
            self.state, self.value, self.piece = "member", JsonValue(), ""
        elif state == "next" and ch == ",":
            self.state = "key"
        elif state == "next" and ch == "}":
            self._end_call(at, out)
        else:
            raise ValueError(f"unexpected {ch!r}")

    def _value(self, ch: str, at: int, out: list[CallDelta]) -> None:
        """A character of a key or of a member's value."""
        v = self.value
        begins = v.state == "value" and not v.stack
        if begins and ch in _SPACE:
            return
        if begins and self.state == "member":
            self.streaming = (ch == "{" and self.key in ARGS_KEYS and "name" in self.obj
                              and not any(k in self.obj for k in ARGS_KEYS))
            if self.streaming:  # the name is known and the arguments begin: they stream from here
                self._start_call(self.obj["name"], out)
        piece, n = v.feed(ch)
        if self.streaming:
            self._arguments(piece, out)
            self.used = at + n
        else:
            self.piece += piece
        if not v.done:
            return
        if self.state == "key_text":
            self.state, self.key = "colon", json.loads(self.piece)
            return
        self.state = "next"
        if self.key not in self.obj:  # a key written twice keeps its first value
            self.obj[self.key] = _STREAMED if self.streaming else json.loads(self.piece)
        if self.key == "name" and not (isinstance(self.obj["name"], str) and self.obj["name"]):
            raise ValueError("a call's name is not a name")
        self.streaming = False
        if n == 0:  # the character ended a number: it is the object's next one
            self._step(ch, at, out)

    def _end_call(self, at: int, out: list[CallDelta]) -> None:
        if not any(self.obj.get(k) is _STREAMED for k in ARGS_KEYS):  # did not stream: whole now
            call = whole_call(self.obj)
            if call is None:
                raise ValueError("not a call")
            self._start_call(call[0], out)
            self._arguments(call[1], out)
        self.used = at + 1
        self.state = "list_next" if self.in_list else "top"
        self.clean = not self.in_list


def _mistral_name(text: str) -> str:
    """The call's name before `[ARGS]` (Mistral's v11 format writes `name[CALL_ID]id[ARGS]`: the id is the model's
    own, not the call's name)."""
    return text.split("[CALL_ID]")[0].strip()


class NamedArgsReader(Reader):
    """Mistral's `name[ARGS]{...}` calls, each after its own `[TOOL_CALLS]` (the first one's is the
    region's opener); other formats of a name, a marker and a JSON object with their own markers and
    `name_of` (the name in the text before the arguments' marker)."""

    def __init__(self, args_marker: str = "[ARGS]", call_marker: str = "[TOOL_CALLS]",
                 name_of: Callable[[str], str] = _mistral_name):
        super().__init__()
        self.args_marker, self.call_marker, self.name_of = args_marker, call_marker, name_of
        self.state = "name"  # name | args | between
        self.text_of_state = ""  # the name, or the marker between calls, read so far
        self.value = JsonValue()

    def _step(self, ch: str, at: int, out: list[CallDelta]) -> None:
        if self.state == "args":
            v = self.value
            if v.state == "value" and not v.stack:
                if ch in _SPACE:
                    return
                if ch != "{":
                    raise ValueError("the arguments are not a JSON object")
                self._start_call(self.text_of_state, out)
            piece, _ = v.feed(ch)
            self._arguments(piece, out)
            self.used = at + 1
            if v.done:
                self.state, self.text_of_state, self.clean = "between", "", True
            return
        if self.state == "between" and ch in _SPACE:
            return
        self.clean = False
        self.text_of_state += ch
        if self.state == "name" and self.text_of_state.endswith(self.args_marker):
            name = self.name_of(self.text_of_state[:-len(self.args_marker)])
            if not name:
                raise ValueError("a call without a name")
            self.state, self.text_of_state, self.value = "args", name, JsonValue()
        elif self.state == "between":
            if not self.call_marker.startswith(self.text_of_state):
                raise ValueError("text after a call")
            if self.text_of_state == self.call_marker:
                self.state, self.text_of_state = "name", ""
