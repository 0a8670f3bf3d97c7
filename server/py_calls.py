"""Reading Python-style tool calls as their text grows (`pythonic`: `[get_weather(city="Paris"), f(n=2)]`), so
that a call's arguments stream while the model writes them.

`PythonCallReader` gives out a call once its `(` opens: its name, then its keyword arguments as the JSON
object `json.dumps` writes of them. A plain quoted string goes out character by character as it is written
(escapes decoded as Python decodes them); any other value (a number, `True`/`False`/`None`, a list, dict or
tuple of literals, a prefixed or triple-quoted string) once it ends, as `json.dumps(ast.literal_eval(...))`
writes it. Positional arguments, `**kwargs` and values that are not literals end the calls there; the text
after them is left over for content (server/tool_stream.py).
"""

from __future__ import annotations

import ast
import json
import warnings

from server.json_calls import CallDelta, Reader, write_json_chars

_SPACE = " \t\n\r"
_OCTAL = "01234567"
_END = "<|python_end|>"


def _escape_done(esc: str) -> bool:
    """Whether `esc` (an escape sequence after its backslash, not octal) is whole."""
    need = {"x": 3, "u": 5, "U": 9}.get(esc[0])
    if need is not None:
        return len(esc) >= need
    return esc.endswith("}") if esc[0] == "N" else True


class PythonCallReader(Reader):
    """The calls of one `pythonic` region (see the module docstring); `opened`: its `[` was the opener."""

    def __init__(self, opened: bool) -> None:
        super().__init__()
        self.state = "name" if opened else "list"  # list | name | key | value | after_value | after_call | end
        self.acc = ""  # the name, key or marker being read, or a value that goes out whole
        self.params = 0  # keyword arguments of the open call so far
        self.quote = ""  # the quote of the plain string value going out
        self.escape: str | None = None  # an escape sequence of that string being read, after its backslash
        self.name = ""  # the call whose arguments are being read
        self.open = False  # it has gone out (with its first argument's value) and is not closed
        self.pending = ""  # its arguments' text before that value, held until the call goes out
        self.at = 0  # the character being read

    def _step(self, ch: str, at: int, out: list[CallDelta]) -> None:
        self.at, state = at, self.state
        if state == "value":
            self._value(ch, at, out)
        elif ch in _SPACE and (not self.acc or state in ("key", "end")):
            self.acc += ch if state == "key" and self.acc else ""
        elif state == "list":
            if ch != "[":
                raise ValueError("not a list of calls")
            self.state = "name"
        elif state == "name":
            self.clean = False
            if ch == "(" and self.acc.isidentifier():
                self.name, self.state, self.acc, self.params = self.acc, "key", "", 0
            elif ch == "]" and not self.acc and self.calls:  # after a trailing comma
                self.state, self.clean = "end", True
            elif ch.isalnum() or ch == "_":
                self.acc += ch
            else:
                raise ValueError(f"unexpected {ch!r} in a call's name")
        elif state == "key":
            if ch == ")" and not self.acc.strip():
                if not self.params:  # no arguments: the call goes out whole
                    self.pending = "{"
                    self._emit("", out)
                self._end_call(out)
            elif ch == "=" and self.acc.strip().isidentifier():
                key = ("{" if not self.params else ", ") + json.dumps(self.acc.strip()) + ": "
                if self.open:
                    self._arguments(key, out)
                else:  # the call goes out with its first argument's value
                    self.pending = key
                self.state, self.acc, self.params = "value", "", self.params + 1
            elif ch.isalnum() or ch == "_":
                self.acc += ch
            else:
                raise ValueError(f"unexpected {ch!r} where a keyword argument belongs")
        elif state == "after_value":
            if ch not in ",)":
                raise ValueError(f"unexpected {ch!r} after an argument")
            if ch == ")":
                self._end_call(out)
            else:
                self.state = "key"
        elif state == "after_call":
            if ch not in ",]":
                raise ValueError(f"unexpected {ch!r} after a call")
            self.state, self.clean = ("name", False) if ch == "," else ("end", True)
        else:  # after the list: only its end marker
            self.acc += ch
            if not _END.startswith(self.acc):
                raise ValueError("text after the list of calls")
            self.clean = self.acc == _END
        if self.open:
            self.used = at + 1  # what the calls account for

    def _emit(self, text: str, out: list[CallDelta]) -> None:
        """More of the open call's arguments; the call goes out first if it has not."""
        if not self.open:
            self._start_call(self.name, out)
            self.open = True
        self._arguments(self.pending + text, out)
        self.pending = ""

    def _end_call(self, out: list[CallDelta]) -> None:
        self._arguments("}", out)
        self.state, self.acc, self.open = "after_call", "", False
        self.used = self.at + 1

    def _value(self, ch: str, at: int, out: list[CallDelta]) -> None:
        if self.quote:
            self._string(ch, out)
        elif not self.acc and ch in _SPACE:
            pass
        elif self.acc in ('"', "'") and ch != self.acc:  # a plain string: it goes out as it comes
            self.quote, self.acc = self.acc, ""
            self._emit('"', out)
            self._string(ch, out)
        elif ch in ",)" and self._whole_value(out):
            self._step(ch, at, out)
        else:
            self.acc += ch

    def _whole_value(self, out: list[CallDelta]) -> bool:
        """The value read so far, if it is whole (the `,` or `)` that follows ends it) and a literal: written
        out, True. False while it is not whole (that character belongs to it); ValueError if not a literal."""
        try:
            value = ast.literal_eval(self.acc.strip())
        except SyntaxError:
            return False
        except (ValueError, TypeError, MemoryError, RecursionError) as e:
            raise ValueError(f"{self.acc.strip()!r} is not a literal") from e
        try:
            text = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{self.acc.strip()!r} is not a JSON value") from e
        self._emit(text, out)
        self.state, self.acc = "after_value", ""
        return True

    def _string(self, ch: str, out: list[CallDelta]) -> None:
        esc = self.escape
        if esc is not None and esc[:1] in tuple(_OCTAL) and (len(esc) == 3 or ch not in _OCTAL):
            self._decoded(esc, out)  # an octal escape ends at three digits or the first other character
            self._string(ch, out)
        elif esc is not None:
            self.escape = esc + ch
            if self.escape[0] not in _OCTAL and _escape_done(self.escape):
                self._decoded(self.escape, out)
        elif ch == "\\":
            self.escape = ""
        elif ch == self.quote:
            self._arguments('"', out)
            self.quote, self.state = "", "after_value"
        elif ch == "\n":
            raise ValueError("a newline in a string")
        else:
            self._arguments(write_json_chars(ch), out)

    def _decoded(self, esc: str, out: list[CallDelta]) -> None:
        self.escape = None
        try:
            with warnings.catch_warnings():  # an unknown escape stands for itself, with a warning
                warnings.simplefilter("ignore")
                text = ast.literal_eval(f'"\\{esc}"')
        except (ValueError, SyntaxError) as e:
            raise ValueError(f"invalid escape \\{esc}") from e
        self._arguments(write_json_chars(text), out)
