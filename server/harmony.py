"""gpt-oss's replies in OpenAI's harmony format: messages on channels, split into reasoning, answer and tool calls.

A gpt-oss reply is a run of messages, each a header then a body (the markers are special tokens):

    <|channel|>analysis<|message|>REASONING<|end|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{ARGS}<|call|>

(the recipient may also sit in the header before the channel: `<|start|>assistant to=functions.NAME<|channel|>...`).
The `analysis` channel is reasoning, `final` the answer, `commentary` without a recipient a preamble shown as answer;
a message to a recipient is a tool call. `<|return|>` and `<|call|>` end generation (they are gpt-oss's stop
tokens, so a reply holds neither unless generation ran on past them).

`HarmonyStream` reads a reply as it grows (with the same results as reading it whole) for the `openai_gptoss`
reasoning parser (server/reasoning.py): reasoning out, answer text out, and every tool call put back into the
answer in one form, `<|channel|>commentary to=RECIPIENT <|constrain|>json<|message|>ARGS<|call|>`, which the
`openai` tool-call parser (server/tool_parsers.py) reads. A reply that does not open with a header is all answer.
"""

from __future__ import annotations

import re
from typing import Literal

from jaxserve.detokenizer import partial_stop_suffix
from server.split_stream import SplitStream

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
_BODY_ENDS = (END, CALL, RETURN, START)  # (a message may run into the next one's `<|start|>`)
_CHANNEL_RE = re.compile(re.escape(CHANNEL) + r"([^\s<]+)")
_RECIPIENT_RE = re.compile(r"\bto=([^\s<]+)")
CALL_OPENER = f"{CHANNEL}commentary to="  # how a tool call reaches the tool-call parser


def parse_header(header: str) -> tuple[str | None, str | None]:
    """A message header's channel and recipient (None where it names none)."""
    channel, recipient = _CHANNEL_RE.search(header), _RECIPIENT_RE.search(header)
    return channel and channel.group(1), recipient and recipient.group(1)


class HarmonyStream(SplitStream):
    """Splits one growing harmony reply into reasoning and answer (tool calls in the answer, in one form)."""

    def __init__(self):
        self.buf = ""
        self.mode: Literal["start", "header", "body", "plain"] = "start"
        self.kind: Literal["reasoning", "answer", "call"] = "answer"  # the open message's
        self.reasoned = False  # the reply has an analysis message (possibly empty)

    def _drain(self, final: bool) -> tuple[str, str]:
        out = {"reasoning": [], "answer": []}
        while True:
            if self.mode == "start":
                head = self.buf.lstrip()
                if head.startswith((CHANNEL, START)):
                    self.mode, self.buf = "header", head
                elif not final and (not head or CHANNEL.startswith(head) or START.startswith(head)):
                    break  # may still open with a header
                else:
                    self.mode = "plain"
            if self.mode == "plain":  # not harmony: all answer
                out["answer"].append(self.buf)
                self.buf = ""
                break
            if self.mode == "header":
                at = self.buf.find(MESSAGE)
                if at < 0:
                    if final:  # a header cut short says nothing
                        self.buf = ""
                    break
                channel, recipient = parse_header(self.buf[:at])
                self.buf, self.mode = self.buf[at + len(MESSAGE):], "body"
                if recipient is not None:
                    self.kind = "call"
                    out["answer"].append(f"{CALL_OPENER}{recipient} {CONSTRAIN}json{MESSAGE}")
                elif channel == "analysis":
                    self.kind, self.reasoned = "reasoning", True
                else:  # final, or a commentary preamble
                    self.kind = "answer"
            if self.mode == "body":
                found = [(at, m) for m in _BODY_ENDS if (at := self.buf.find(m)) >= 0]
                if not found:
                    hold = 0 if final else partial_stop_suffix(self.buf, _BODY_ENDS)
                    out["answer" if self.kind == "call" else self.kind].append(self.buf[:len(self.buf) - hold])
                    self.buf = self.buf[len(self.buf) - hold:]
                    if final and self.kind == "call":
                        out["answer"].append(CALL)
                    break
                at, marker = min(found)
                out["answer" if self.kind == "call" else self.kind].append(self.buf[:at])
                if self.kind == "call":
                    out["answer"].append(CALL)
                self.buf = self.buf[at + (0 if marker == START else len(marker)):]
                self.mode = "header" if marker == START else "start"
        return "".join(out["reasoning"]), "".join(out["answer"])
