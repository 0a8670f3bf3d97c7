"""Reading a reply as it grows: content and tool calls apart, in the format of a tool-call parser
(server/tool_parsers.py).

A `ToolCallStream` reads a reply as it grows: text that cannot be the start of a call goes out as
content at once, and calls go out as they are written: a call's name once its arguments begin, then its
arguments piece by piece, as `json.dumps` writes them (a `Reader` per format: server/json_calls.py for the
JSON formats, server/xml_calls.py for `qwen3_coder`, server/py_calls.py for `pythonic`). A JSON call whose
arguments come first or as a JSON string goes out whole once its object closes.
Text that opens a call and does not parse before the call goes out is content, so nothing is lost; a
region that stops being calls after some went out gives the rest of its text as content, and a call cut
short (by the token limit, or by the model closing the region) keeps the arguments written so far.
Whitespace is held until text follows it, and is dropped at the end of a reply that made calls. Parsing
a whole reply is feeding it to a new stream and finishing it, so the two never disagree.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from jaxserve.detokenizer import partial_stop_suffix
from server.json_calls import CallDelta, Reader

if TYPE_CHECKING:
    from server.tool_parsers import ToolParser

Schemas = Mapping[str, Any]  # a tool's name -> its parameters' JSON schema


@dataclass(frozen=True)
class ParsedCall:
    """One call: the function's name and its arguments as JSON text (an object)."""

    name: str
    arguments: str


def join_calls(deltas: list[CallDelta]) -> list[ParsedCall]:
    """The calls that a stream's pieces make up."""
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    for d in deltas:
        if d.name is not None:
            names[d.index] = d.name
        args[d.index] = args.get(d.index, "") + d.arguments
    return [ParsedCall(names[i], args[i]) for i in sorted(names)]


class ToolCallStream:
    """Splits one growing reply into content and calls (see the module docstring)."""

    def __init__(self, parser: ToolParser, schemas: Schemas | None = None):
        self.parser = parser
        self.schemas: Schemas = schemas or {}
        self.buf = ""  # text read and not yet given out
        self.mode: Literal["start", "content", "region"] = "start" if parser.leading else "content"
        self.opener = ""
        self.body = ""  # the open region's text after its opener
        self.reader: Reader | None = None  # the open region's reader, once its body has begun
        self.calls = 0  # calls given out before the open region
        self.made_calls = False
        self._space = ""  # whitespace held until text follows it

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        """The content and the pieces of calls that `text`, the reply's next piece, settles."""
        self.buf += text
        return self._drain(final=False)

    def finish(self) -> tuple[str, list[CallDelta]]:
        """What is left at the end of the reply: an unclosed region is read as it stands."""
        content, calls = self._drain(final=True)
        if not self.made_calls:
            content += self._space
        self._space = ""
        return content, calls

    def _content(self, text: str) -> str:
        """`text` as content, with whitespace at its end held back."""
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body):]
        return body

    def _drain(self, final: bool) -> tuple[str, list[CallDelta]]:
        p, out, calls = self.parser, [], []
        while self.buf or final and self.mode == "region":
            if self.mode == "start":
                head = self.buf.lstrip()
                opener = next((o for o in p.openers if head.startswith(o)), None)
                if opener is not None:  # the whitespace before it comes back if it is no call
                    self._space, self.buf = self.buf[:len(self.buf) - len(head)], head[len(opener):]
                    self.mode, self.opener = "region", opener
                elif head and not any(o.startswith(head) for o in p.openers) or final:
                    self.mode = "content"
                else:
                    break  # whitespace, or the start of an opener: wait for more
            elif self.mode == "content":
                markers = () if p.leading else p.openers  # a leading format's call opens the reply or never
                hits = [(self.buf.find(o), o) for o in markers if o in self.buf]
                if hits:
                    at, opener = min(hits)
                    out.append(self._content(self.buf[:at]))
                    self.buf = self.buf[at + len(opener):]
                    self.mode, self.opener = "region", opener
                    continue
                hold = 0 if final else partial_stop_suffix(self.buf, markers)
                out.append(self._content(self.buf[:len(self.buf) - hold]))
                self.buf = self.buf[len(self.buf) - hold:]
                break
            else:
                end = self.buf.find(p.closer) if p.closer else -1
                closed = end >= 0 or final
                cut = end if end >= 0 else len(self.buf) - (0 if closed else partial_stop_suffix(self.buf, (p.closer,)))
                calls += self._read(self.buf[:cut])
                self.buf = self.buf[cut + (len(p.closer) if end >= 0 else 0):]
                if not closed:
                    break
                out.append(self._end_region(p.closer if end >= 0 else "", calls))
                self.mode = "content"
        return "".join(out), calls

    def _read(self, text: str) -> list[CallDelta]:
        """The call pieces that `text`, more of the open region, settles."""
        self.body += text
        if self.reader is None and self.body.strip():
            self.reader = self.parser.reader(self.opener, self.body.lstrip()[0], self.schemas)
            text = self.body
        if self.reader is None:
            return []
        deltas = [CallDelta(self.calls + d.index, d.name, d.arguments) for d in self.reader.feed(text)]
        if deltas:  # the whitespace before a call is dropped
            self.made_calls, self._space = True, ""
        return deltas

    def _end_region(self, closer: str, calls: list[CallDelta]) -> str:
        """The content at the end of a region (its calls go into `calls`): what its reader left over, or,
        when no call came out of it as it grew, the whole region if it holds no call."""
        reader, body, self.reader, self.body = self.reader, self.body, None, ""
        if reader is not None:
            calls += [CallDelta(self.calls + d.index, d.name, d.arguments) for d in reader.finish()]
        if reader is not None and reader.calls:
            self.made_calls, self._space = True, ""
            self.calls += reader.calls
            rest = reader.leftover()
            return self._content(rest + closer) if rest else ""
        found = self.parser.parse_region(self.opener, body, self.schemas)
        if not found:  # not a call after all: the text goes out as it came
            return self._content(self.opener + body + closer)
        self.made_calls, self._space = True, ""
        calls += [CallDelta(self.calls + i, c.name, c.arguments) for i, c in enumerate(found)]
        self.calls += len(found)
        return ""
