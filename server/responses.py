"""L1 output: OpenAI response and chunk objects built from the engine's cumulative outputs.

`ChoiceCursor` remembers how much of one completion a stream has already sent, so each new
cumulative `CompletionOutput` becomes a delta: the new text, the new logprobs, the finish reason once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from jaxserve.outputs import CompletionOutput, SampleLogprobs, TokenLogprobs
from server.json_calls import Reader
from server.reasoning import ReasoningStream
from server.tool_stream import ToolCallStream


def sse(obj: Any) -> bytes:
    """One server-sent event carrying `obj` as JSON."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """The `usage` object, with cached prompt tokens in `prompt_tokens_details`."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class TokenText:
    """Each token id's own text, as logprobs report it (cached: the same ids come back often)."""

    def __init__(self, tokenizer: Any, as_ids: bool = False):
        """`as_ids`: each token as "token_id:N" (vLLM's `return_tokens_as_token_ids`), whatever its text (the form
        a server without a tokenizer, --skip-tokenizer-init, writes)."""
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._as_ids = as_ids

    def __call__(self, token_id: int, entry_text: str | None = None) -> str:
        if self._as_ids:
            return f"token_id:{token_id}"
        if entry_text is not None:
            return entry_text
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._cache) < 65536:
                self._cache[token_id] = text
        return text


def _finite(logprob: float) -> float:
    """A logprob as JSON can carry it: a token filtered out (-inf, `--logprobs-mode processed_logprobs`) is
    -9999.0, as vLLM writes it."""
    return max(logprob, -9999.0)


def _top(entries: TokenLogprobs, top_n: int) -> list[tuple[int, Any]]:
    ranked = [(tid, lp) for tid, lp in entries.items() if lp.rank is not None and lp.rank <= top_n]
    return sorted(ranked, key=lambda item: item[1].rank)


def chat_logprobs(text_of: TokenText, token_ids: list[int], entries: SampleLogprobs, top_n: int) -> list[dict]:
    """Chat's `logprobs.content` items for the given positions."""
    out = []
    for tid, pos in zip(token_ids, entries, strict=False):
        lp = pos.get(tid)
        token = text_of(tid, lp.decoded_token if lp else None)
        top = []
        for t, e in _top(pos, top_n):
            s = text_of(t, e.decoded_token)
            top.append({"token": s, "logprob": _finite(e.logprob), "bytes": list(s.encode())})
        out.append({"token": token, "logprob": _finite(lp.logprob) if lp else None, "bytes": list(token.encode()),
                    "top_logprobs": top})
    return out


def completion_logprobs(text_of: TokenText, token_ids: list[int], entries: SampleLogprobs, top_n: int,
                        offset: int) -> tuple[dict, int]:
    """Completions' `logprobs` object for the given positions, and the text offset after them. A
    position without an entry (None: the first prompt token) has no logprob and no top logprobs."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, pos in zip(token_ids, entries, strict=False):
        lp = pos.get(tid) if pos is not None else None
        s = text_of(tid, lp.decoded_token if lp else None)
        tokens.append(s)
        token_lps.append(_finite(lp.logprob) if lp else None)
        tops.append({text_of(t, e.decoded_token): _finite(e.logprob) for t, e in _top(pos, top_n)}
                    if top_n and pos is not None else None)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset


def echo_logprobs(text_of: TokenText, out: Any, token_ids: list[int], entries: SampleLogprobs,
                  top_n: int) -> tuple[dict, int]:
    """Completions' `logprobs` for an echoed prompt followed by the given completion positions."""
    prompt, offset = completion_logprobs(text_of, out.prompt_token_ids, out.prompt_logprobs or [], top_n, 0)
    rest, offset = completion_logprobs(text_of, token_ids, entries, top_n, offset)
    return {k: prompt[k] + rest[k] for k in prompt}, offset


def prompt_logprobs_json(entries: list | None) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}}."""
    if entries is None:
        return None
    return [None if pos is None else
            {str(t): {"logprob": e.logprob, "rank": e.rank, "decoded_token": e.decoded_token} for t, e in pos.items()}
            for pos in entries]


@dataclass
class Delta:
    """What one completion gained since the last chunk."""

    text: str
    token_ids: list[int]  # the tokens of `logprobs`
    logprobs: SampleLogprobs
    finish_reason: str | None
    stop_reason: int | str | None
    new_token_ids: list[int] = field(default_factory=list)  # every token it gained


class ChoiceCursor:
    """How far a stream has got through one completion."""

    def __init__(self) -> None:
        self.text_len = 0
        self.num_tokens = 0
        self.num_logprobs = 0
        self.finished = False
        self.started = False
        self.text_offset = 0
        self.tool_call_id = ""  # a named tool call's id, once its first chunk went out
        self.tool_stream: ToolCallStream | None = None  # an "auto" reply's parser state
        self.calls_reader: Reader | None = None  # a "required" reply's reader of its list of calls
        self.calls_sent = 0  # the calls of an "auto" or "required" reply sent so far
        self.reasoning_stream: ReasoningStream | None = None  # the reasoning parser's state
        self.answer = ""  # a forced tool call's reply after its reasoning, so far

    def advance(self, c: CompletionOutput) -> Delta | None:
        """The new part of `c`, or None if nothing changed."""
        if self.finished:
            return None
        text = c.text[self.text_len:]
        lps = (c.logprobs or [])[self.num_logprobs:]
        ids = c.token_ids[self.num_logprobs:] if c.logprobs is not None else []
        new_tokens = len(c.token_ids) - self.num_tokens
        if not text and not lps and c.finish_reason is None and new_tokens == 0:
            return None
        self.text_len = max(self.text_len, len(c.text))
        self.num_logprobs += len(lps)
        new_ids = list(c.token_ids[self.num_tokens:])
        self.num_tokens = len(c.token_ids)
        self.finished = c.finish_reason is not None
        return Delta(text, ids, lps, c.finish_reason, c.stop_reason, new_ids)
