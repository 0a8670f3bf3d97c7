"""Reasoning parsers: a thinking model's reasoning split from its answer (`--reasoning-parser`).

Reasoning models write their thoughts between markers (most between `<think>` and `</think>`), then the answer. The server
returns the thoughts in the message's `reasoning` field (and in `reasoning_content`, the name
DeepSeek's API and earlier vLLM use) and the answer in `content`; the answer alone goes on to the
tool-call parser. The parsers are named as vLLM names them:

| name | reasoning is | models |
| --- | --- | --- |
| `deepseek_v3` | as `deepseek_r1` in a request with `chat_template_kwargs` `{"thinking": true}` (or `enable_thinking`), else all answer | DeepSeek-V3.1, V3.2 (hybrid thinking) |
| `deepseek_r1` | everything up to `</think>` (a leading `<think>` dropped; the chat template often puts it in the prompt); a reply with no `</think>` is all reasoning, cut short | DeepSeek-R1 and its distills, QwQ, Qwen3 thinking-only models |
| `exaone4` | as `deepseek_r1` in a request with `chat_template_kwargs` `{"enable_thinking": true}`, else all answer | EXAONE 4.0 (reasoning mode) |
| `kimi_k2` | as `deepseek_r1`, the opening of a tool call section also ending it (the section kept in the answer, for the `kimi_k2` tool-call parser); all answer with `chat_template_kwargs` `{"thinking": false}` | Kimi K2 Thinking |
| `olmo3` | as `deepseek_r1` (OLMo 3's markers are plain text, several tokens each; the parsers read text) | OLMo 3 Think |
| `qwen3` | a reply that opens with `<think>`, up to `</think>`; a reply that does not open with it is all answer (thinking switched off with `enable_thinking: false`) | Qwen3, SmolLM3 |
| `glm45` | as `qwen3` | GLM-4.5, GLM-4.6 |
| `apertus` | a reply that opens with its inner-prefix special token, up to its inner-suffix one (kept in the text); else all answer | Apertus |
| `seed_oss` | a reply that opens with `<seed:think>`, up to `</seed:think>` (special tokens: kept in the text); else all answer | Seed-OSS |
| `ernie45` | as `deepseek_r1`; an answer between `<response>` and `</response>` is taken from between them | ERNIE-4.5-21B-A3B-Thinking |
| `granite` | a reply that opens with "Here is my thought process:" (or "Here's ..."), up to "Here is my response:" (or "Here's ..."); else all answer | Granite 3.2 and 3.3 with `chat_template_kwargs: {"thinking": true}` |
| `mistral` | a reply that opens with `[THINK]`, up to `[/THINK]` (special tokens: the reply is detokenized with them); else all answer | Magistral |
| `gemma4` | a reply that opens with `<|channel>`, up to `<channel|>` (its `thought` label and newline dropped; special tokens: kept in the text), a `<|tool_call>` also ending it (kept in the answer, for the `gemma4` tool-call parser); else all answer (thinking off) | Gemma 4 |
| `openai_gptoss` | the `analysis` channel's messages of a harmony reply; the answer is the `final` channel's (and commentary preambles), tool calls passed on to the `openai` tool-call parser (server/harmony.py) | gpt-oss |

A `ReasoningStream` reads a reply as it grows, with the same results as reading it whole: text that
may still be a marker is held until it is clear.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from jaxserve.detokenizer import partial_stop_suffix
from jaxserve.sampling_params import SamplingParams
from server.harmony import HarmonyStream
from server.split_stream import SplitStream


class ReasoningParser:
    name: ClassVar[str]
    # Whether a reply that does not open with a start marker is reasoning (True) or answer (False).
    implicit_start: ClassVar[bool]
    starts: ClassVar[tuple[str, ...]] = ("<think>",)  # what opens the reasoning (any of them)
    ends: ClassVar[tuple[str, ...]] = ("</think>",)  # what closes it
    keeps_special_tokens: ClassVar[bool] = False  # the markers are special tokens the parser must see
    wrap: ClassVar[tuple[str, str] | None] = None  # markers the answer may come between (dropped, with their newlines)
    opens_answer: ClassVar[tuple[str, ...]] = ()  # markers that end the reasoning and begin the answer (kept in it)

    def stream(self) -> ReasoningStream | HarmonyStream:
        return ReasoningStream(self.implicit_start, self.starts, self.ends, self.wrap, self.opens_answer)

    def answer_markers(self) -> tuple[tuple[str, ...], tuple[str, ...], bool] | None:
        """Where the answer begins, for an output constraint that holds from there
        (`StructuredOutputsParams.after_reasoning`): (start markers, end markers, implicit start); None where
        the engine cannot tell it (the constraint then holds throughout)."""
        return self.starts, self.ends, self.implicit_start

    def for_request(self, chat_template_kwargs: Mapping[str, Any]) -> ReasoningParser | None:
        """The parser of a request with these chat template arguments; None where its reply is all answer."""
        return self

    def parse(self, text: str) -> tuple[str | None, str]:
        """A whole reply's reasoning (None when it has none) and answer."""
        s = self.stream()
        r1, c1 = s.feed(text)
        r2, c2 = s.finish()
        return (r1 + r2 if s.reasoned else None), c1 + c2


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek_r1"
    implicit_start = True


class Olmo3Parser(DeepSeekR1Parser):
    name = "olmo3"


class Exaone4Parser(DeepSeekR1Parser):
    name = "exaone4"

    def for_request(self, chat_template_kwargs: Mapping[str, Any]) -> ReasoningParser | None:
        return DeepSeekR1Parser() if chat_template_kwargs.get("enable_thinking") else None


class KimiK2Parser(DeepSeekR1Parser):
    name = "kimi_k2"
    keeps_special_tokens = True
    opens_answer = ("<|tool_calls_section_begin|>",)  # a tool call section ends the thoughts unclosed

    def for_request(self, chat_template_kwargs: Mapping[str, Any]) -> ReasoningParser | None:
        return self if chat_template_kwargs.get("thinking", True) else None


class MiniMaxM2Parser(DeepSeekR1Parser):
    """MiniMax-M2's replies begin in its thoughts (its template opens them), which end at `</think>`."""

    name = "minimax_m2"
    keeps_special_tokens = True  # (its markers are added tokens of its vocabulary)


class DeepSeekV3Parser(DeepSeekR1Parser):
    name = "deepseek_v3"

    def for_request(self, chat_template_kwargs: Mapping[str, Any]) -> ReasoningParser | None:
        thinking = chat_template_kwargs.get("thinking", chat_template_kwargs.get("enable_thinking"))
        return DeepSeekR1Parser() if thinking else None


class Qwen3Parser(ReasoningParser):
    name = "qwen3"
    implicit_start = False


class Glm45Parser(Qwen3Parser):
    name = "glm45"


class ApertusParser(ReasoningParser):
    name = "apertus"
    implicit_start = False
    starts, ends = ("<|inner_prefix|>",), ("<|inner_suffix|>",)
    keeps_special_tokens = True


class SeedOssParser(ReasoningParser):
    name = "seed_oss"
    implicit_start = False
    starts, ends = ("<seed:think>",), ("</seed:think>",)
    keeps_special_tokens = True


class Ernie45Parser(ReasoningParser):
    name = "ernie45"
    implicit_start = True
    wrap = ("<response>", "</response>")


class GraniteParser(ReasoningParser):
    name = "granite"
    implicit_start = False
    starts = ("Here is my thought process:", "Here's my thought process:")
    ends = ("Here is my response:", "Here's my response:")


class MistralParser(ReasoningParser):
    name = "mistral"
    implicit_start = False
    starts, ends = ("[THINK]",), ("[/THINK]",)
    keeps_special_tokens = True


class Gemma4Parser(ReasoningParser):
    name = "gemma4"
    implicit_start = False
    starts, ends, opens_answer = ("<|channel>thought\n", "<|channel>"), ("<channel|>",), ("<|tool_call>",)
    keeps_special_tokens = True


class GptOssParser(ReasoningParser):
    name = "openai_gptoss"
    implicit_start = False
    keeps_special_tokens = True

    def stream(self) -> HarmonyStream:
        return HarmonyStream()

    def answer_markers(self) -> tuple[tuple[str, ...], tuple[str, ...], bool]:
        return (), ("<|channel|>final<|message|>",), True  # (the final channel's message is the answer)


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (ApertusParser, DeepSeekR1Parser, Olmo3Parser, Exaone4Parser, KimiK2Parser, DeepSeekV3Parser, Qwen3Parser, Glm45Parser, Ernie45Parser, SeedOssParser,
                        GraniteParser, MistralParser, GptOssParser, MiniMaxM2Parser, Gemma4Parser)}


def constraint_after_reasoning(parser: ReasoningParser | None, params: SamplingParams) -> SamplingParams | None:
    """A chat request's sampling parameters with its output constraint (a forced tool call's too) holding from
    where the answer begins (vLLM applies one after the reasoning), or None where it holds throughout: no
    reasoning parser, no constraint, or markers the engine cannot tell."""
    so = params.structured_outputs
    markers = parser.answer_markers() if parser is not None else None
    if so is None or markers is None:
        return None
    return dataclasses.replace(params, structured_outputs=dataclasses.replace(so, after_reasoning=markers))


def request_parser(parser: ReasoningParser | None, req: Any) -> ReasoningParser | None:
    """The server's reasoning parser as it applies to request `req` (by its chat template arguments)."""
    return None if parser is None else parser.for_request(getattr(req, "chat_template_kwargs", None) or {})


def reasoning_params(parser: ReasoningParser | None, params: SamplingParams) -> SamplingParams:
    """A chat request's sampling parameters under the reasoning parser: its special tokens kept in the text
    where the parser reads them, its output constraint after the reasoning (`constraint_after_reasoning`)."""
    if parser is not None and parser.keeps_special_tokens:
        params = dataclasses.replace(params, skip_special_tokens=False)
    return constraint_after_reasoning(parser, params) or params


def constrained_throughout(parser: ReasoningParser | None, req: Any) -> bool:
    """Whether a request's output constraint holds from its first token (its reply then has no reasoning to
    split off): a completion's always, a chat reply's unless `constraint_after_reasoning` defers it."""
    params, chat = req.common.params, hasattr(req, "messages")
    return params.structured_outputs is not None and (not chat or constraint_after_reasoning(parser, params) is None)


def reasoning_parser(name: str) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name]()


class ReasoningStream(SplitStream):
    """Splits one growing reply into reasoning and answer."""

    def __init__(self, implicit_start: bool, starts: tuple[str, ...], ends: tuple[str, ...],
                 wrap: tuple[str, str] | None = None, opens_answer: tuple[str, ...] = ()):
        self.implicit_start, self.starts, self.ends, self.wrap = implicit_start, starts, ends, wrap
        self.opens_answer = opens_answer
        self.mode: Literal["start", "reasoning", "gap", "answer", "wrapped", "after"] = "start"
        self.buf = ""
        self.reasoned = False  # the reply has a reasoning part (possibly empty)
        self.opened = False  # the wrapped answer's text has begun (the newlines after its opener are dropped)

    def _drain(self, final: bool) -> tuple[str, str]:
        reasoning, answer = "", ""
        if self.mode == "start":
            head = self.buf.lstrip()
            if not final and any(len(m) > len(head) and m.startswith(head) for m in self.starts):
                return "", ""  # may still open with a (longer) start marker
            start = max((m for m in self.starts if head.startswith(m)), key=len, default=None)
            if start is not None:
                self.mode, self.buf, self.reasoned = "reasoning", head[len(start):], True
            elif not final and not head:
                return "", ""  # may still open with a start marker
            elif self.implicit_start:
                self.mode, self.reasoned = "reasoning", True
            else:
                self.mode = "answer"
        if self.mode == "reasoning":
            found = [(at, -len(m)) for m in self.ends if (at := self.buf.find(m)) >= 0]
            found += [(at, 0) for m in self.opens_answer if (at := self.buf.find(m)) >= 0]  # (kept: size 0)
            if found:
                at, size = min(found)  # the first end, the longest there
                reasoning, self.buf, self.mode = self.buf[:at], self.buf[at - size:], "gap"
            else:
                hold = 0 if final else partial_stop_suffix(self.buf, self.ends + self.opens_answer)
                reasoning, self.buf = self.buf[:len(self.buf) - hold], self.buf[len(self.buf) - hold:]
                return reasoning, ""
        if self.mode == "gap":  # the whitespace between </think> and the answer is neither
            self.buf = self.buf.lstrip()
            if self.wrap and self.buf.startswith(self.wrap[0]):
                self.buf, self.mode = self.buf[len(self.wrap[0]):], "wrapped"
            elif self.wrap and not final and self.wrap[0].startswith(self.buf):
                return reasoning, ""  # may still open the answer's wrapper
            elif self.buf:
                self.mode = "answer"
        if self.mode == "wrapped":  # the answer up to the wrapper's end, less the newlines around it
            if not self.opened:
                self.buf = self.buf.lstrip("\n")
                self.opened = bool(self.buf)
            at = self.buf.find(self.wrap[1])
            if at >= 0:
                answer, self.buf, self.mode = self.buf[:at].rstrip("\n"), self.buf[at + len(self.wrap[1]):], "after"
            else:
                # Held: what may begin the wrapper's end, and the newlines before it.
                body = self.buf[:len(self.buf) - partial_stop_suffix(self.buf, (self.wrap[1],))].rstrip("\n")
                hold = 0 if final else len(self.buf) - len(body)
                answer, self.buf = self.buf[:len(self.buf) - hold], self.buf[len(self.buf) - hold:]
                return reasoning, answer
        if self.mode == "after":  # past the wrapper: whitespace alone is dropped, text kept as answer (held till known)
            if self.buf.strip():
                self.mode = "answer"
            elif final:
                self.buf = ""
        if self.mode == "answer":
            answer, self.buf = answer + self.buf, ""
        return reasoning, answer
