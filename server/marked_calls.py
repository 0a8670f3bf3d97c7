"""Tool calls between special-token markers: DeepSeek's and Kimi K2's formats (server/tool_parsers.py).

| name | the model writes | models |
| --- | --- | --- |
| `deepseek_v3` | `<｜tool▁calls▁begin｜>`, per call `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`, a fenced JSON block of its arguments and `<｜tool▁call▁end｜>`, then `<｜tool▁calls▁end｜>` | DeepSeek-V3, R1-0528 |
| `deepseek_v31` | as `deepseek_v3`, a call being `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>` | DeepSeek-V3.1, V3.2 |
| `kimi_k2` | `<\\|tool_calls_section_begin\\|>`, per call `<\\|tool_call_begin\\|>functions.NAME:N<\\|tool_call_argument_begin\\|>{...}<\\|tool_call_end\\|>`, then `<\\|tool_calls_section_end\\|>` | Kimi K2 |

A call's arguments stream as they are written in the last two; `deepseek_v3`'s calls go out whole as their region
ends (their JSON sits in a Markdown fence).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import ClassVar

from server.json_calls import NamedArgsReader, Reader
from server.tool_parser_base import ToolParser, call_of, json_values
from server.tool_stream import ParsedCall, Schemas

DS_CALLS, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_SEP, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
KIMI_CALLS, KIMI_CALLS_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL, KIMI_ARGS, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"

_DS_V3_CALL = re.compile(re.escape(DS_CALL) + r"\s*function\s*" + re.escape(DS_SEP)
                         + r"([^\n]+?)\s*```(?:json)?\s*(.*?)\s*```\s*" + re.escape(DS_CALL_END), re.S)


class MarkedCallReader(NamedArgsReader):
    """Calls written `BEGIN header SEP {...} END`, one after another (whitespace between); a call's name is
    `name_of(header)`. The region may end after any call's END."""

    def __init__(self, begin: str, sep: str, end: str, name_of: Callable[[str], str] = str.strip):
        super().__init__(args_marker=sep, call_marker=end + begin,
                         name_of=lambda header: name_of(header.strip().removeprefix(begin)))
        self.end = end

    def _step(self, ch: str, at: int, out: list) -> None:
        super()._step(ch, at, out)
        if self.state == "between" and self.text_of_state == self.end:  # (the marker is the call's)
            self.clean, self.used = True, at + 1


def _marked_calls(body: str, begin: str, sep: str, end: str, name_of: Callable[[str], str]) -> list[ParsedCall] | None:
    """The calls of a region written `BEGIN header SEP {...} END` per call; None if it holds anything else."""
    pieces = body.strip().split(begin)
    if pieces[0].strip() or len(pieces) < 2:
        return None
    calls = []
    for piece in pieces[1:]:
        header, found, rest = piece.partition(sep)
        args, closed, after = rest.partition(end)
        values = json_values(args) if found and closed and not after.strip() else None
        call = call_of({"name": name_of(header), "arguments": values[0]}) if values and len(values) == 1 else None
        if call is None:
            return None
        calls.append(call)
    return calls


def kimi_name(header: str) -> str:
    """The function a Kimi K2 call names: `functions.NAME:N` (N the call's index) -> NAME."""
    return header.strip().removeprefix("functions.").rsplit(":", 1)[0]


class DeepSeekV3Parser(ToolParser):
    name = "deepseek_v3"
    openers = (DS_CALLS,)
    closer = DS_CALLS_END
    keeps_special_tokens = True

    def parse_region(self, opener: str, body: str, schemas: Schemas) -> list[ParsedCall] | None:
        if _DS_V3_CALL.sub("", body).strip():
            return None
        calls = []
        for m in _DS_V3_CALL.finditer(body):
            try:
                call = call_of({"name": m.group(1).strip(), "arguments": json.loads(m.group(2))})
            except ValueError:
                return None
            if call is None:
                return None
            calls.append(call)
        return calls or None


class _MarkedCallsParser(ToolParser):
    """Calls `CALL header SEP {...} END`, one after another, in a region between special-token markers; a call's
    name is `name_of(header)`."""

    keeps_special_tokens = True
    call: ClassVar[str]
    sep: ClassVar[str]
    end: ClassVar[str]
    name_of: ClassVar[Callable[[str], str]] = staticmethod(str.strip)

    def parse_region(self, opener: str, body: str, schemas: Schemas) -> list[ParsedCall] | None:
        return _marked_calls(body, self.call, self.sep, self.end, self.name_of)

    def reader(self, opener: str, head: str, schemas: Schemas) -> Reader:
        return MarkedCallReader(self.call, self.sep, self.end, self.name_of)


class DeepSeekV31Parser(_MarkedCallsParser):
    name = "deepseek_v31"
    openers, closer = (DS_CALLS,), DS_CALLS_END
    call, sep, end = DS_CALL, DS_SEP, DS_CALL_END


class KimiK2Parser(_MarkedCallsParser):
    name = "kimi_k2"
    openers, closer = (KIMI_CALLS,), KIMI_CALLS_END
    call, sep, end = KIMI_CALL, KIMI_ARGS, KIMI_CALL_END
    name_of = staticmethod(kimi_name)
