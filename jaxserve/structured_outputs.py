"""Structured outputs: generation constrained to a JSON schema, a regex, a choice, a grammar, or
structural tags (free text in which each tool call the model begins follows its schema).

`StructuredOutputsParams` names the constraint as vLLM's does (json, regex, choice, grammar,
json_object, structural_tag; exactly one). The constraint is compiled by llguidance into a grammar, checked when
the parameters are made, so a bad schema or regex fails the request before it is queued.

While a request is served, a `GrammarMatcher` follows its tokens on the host. Before each step,
the engine asks every constrained row's matcher for the tokens it may produce next, as a bitmask
of 32 tokens per int32 word ([rows, ceil(vocab / 32)]); the sampler masks every other token to
-inf on the device (see `sampler.sample`). After the step, the matcher consumes the sampled token.
Once the grammar is complete, only the end-of-sequence tokens stay allowed, so the request ends
with finish_reason "stop" as soon as its value is whole.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxserve.structural_tag_format import format_grammar

_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # a dependency of jaxserve; missing only from a partial install
        raise ValueError("structured outputs need the llguidance package (pip install llguidance)") from e
    return llguidance


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on what a request may generate; exactly one field is set.

    Attributes:
      json: a JSON schema (a dict, or its JSON text); the output is one JSON value that conforms.
      regex: a regular expression (Rust `regex` syntax) the whole output matches.
      choice: a list of strings; the output is exactly one of them.
      grammar: a context-free grammar in Lark syntax (llguidance's dialect) or in llama.cpp's GBNF.
      json_object: True for any JSON object (OpenAI's `response_format` {"type": "json_object"}).
      structural_tag: {"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]} (a dict, or its
        JSON text; vLLM's and xgrammar's form): the output is free text until it writes a trigger, after
        which it must go on with the `begin` of a structure starting with that trigger, a JSON value of
        the structure's schema, and its `end` (then free text again). Or {"format": {...}}: xgrammar's tree
        of formats (`structural_tag_format`).
      after_reasoning: (start markers, end markers, implicit start) of a reasoning model's thoughts: the
        constraint then holds from where its answer begins (the server sets it from `--reasoning-parser`, as
        vLLM applies a constraint after the reasoning). The thoughts run from a start marker (or, with an
        implicit start, from the first token) to an end marker; a reply that opens with no start marker is all
        answer. A prompt whose last marker is an end marker (thinking switched off in the chat template) has
        the answer begin at once.
    """

    json: str | Mapping[str, Any] | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | Mapping[str, Any] | None = None
    after_reasoning: tuple[tuple[str, ...], tuple[str, ...], bool] | None = None

    def __post_init__(self) -> None:
        given = [name for name in _FIELDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, json_object, structural_tag; "
                f"got {', '.join(given) if given else 'none'}"
            )
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice) or not self.choice:
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            object.__setattr__(self, "choice", list(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"structured_outputs.{name} must be a string, got {type(value).__name__}")
        for name in ("json", "structural_tag"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, Mapping)):
                what = "a JSON schema object" if name == "json" else "a JSON object"
                raise ValueError(f"structured_outputs.{name} must be {what}, got {type(value).__name__}")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError("structured_outputs.json_object must be true when given")
        if self.after_reasoning is not None:
            starts, ends, implicit = self.after_reasoning
            if not ends or not all(isinstance(m, str) and m for m in (*starts, *ends)) or not isinstance(implicit, bool):
                raise ValueError("structured_outputs.after_reasoning must be (start markers, end markers, implicit "
                                 f"start), with at least one end marker, got {self.after_reasoning!r}")
            object.__setattr__(self, "after_reasoning", (tuple(starts), tuple(ends), implicit))
        self.grammar_spec()  # compiled and checked now, so a bad constraint fails at the request

    @property
    def kind(self) -> str:
        return next(name for name in _FIELDS if getattr(self, name) not in (None, False))

    def grammar_spec(self) -> str:
        """The constraint as an llguidance grammar; ValueError naming the field if it does not compile."""
        value = getattr(self, self.kind)
        if self.kind in ("json", "structural_tag") and isinstance(value, str):  # one cache entry per schema
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"structured_outputs.{self.kind} is invalid: {e}") from None
        return _compile(self.kind, _key(value))


def _key(value: Any) -> Any:
    """A hashable form of a field's value (schemas are dicts), for the compile cache."""
    if isinstance(value, Mapping):
        return json.dumps(value, sort_keys=True)
    if isinstance(value, list):
        return tuple(value)
    return value


@functools.lru_cache(maxsize=256)
def _compile(kind: str, value: Any) -> str:
    """The llguidance grammar of one constraint (`value` hashable, see `_key`); cached, since a server
    sees the same schema again and again."""
    llg = _llguidance()
    try:
        if kind == "json":
            schema = json.loads(value) if isinstance(value, str) else value
            if not isinstance(schema, Mapping):
                raise ValueError("a JSON schema must be an object")
            spec = llg.LLMatcher.grammar_from_json_schema(schema)
        elif kind == "json_object":
            spec = llg.LLMatcher.grammar_from_json_schema({"type": "object"})
        elif kind == "regex":
            spec = llg.LLMatcher.grammar_from_regex(value)
        elif kind == "choice":
            spec = llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
        elif kind == "structural_tag":
            tag = json.loads(value)
            spec = format_grammar(tag) if isinstance(tag, Mapping) and "format" in tag else \
                llg.grammar_from("lark", llg.StructTag.to_grammar(_struct_tags(tag)))
        else:
            spec = llg.grammar_from("grammar", value)  # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise ValueError(f"structured_outputs.{kind} is invalid: {e}") from None
    error = llg.LLMatcher.validate_grammar(spec)
    if error and not error.startswith("WARNING"):
        raise ValueError(f"structured_outputs.{kind} is invalid: {error.strip()}")
    return spec


def _struct_tags(tag: Any) -> list[Any]:
    """llguidance's structural tags of a `structural_tag` object; ValueError naming what is malformed."""
    llg = _llguidance()
    if not isinstance(tag, Mapping):
        raise ValueError("it must be an object with 'structures' and 'triggers', or with 'format'")
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("'triggers' must be a non-empty list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise ValueError("'structures' must be a non-empty list of {'begin', 'schema', 'end'}")
    tags = []
    for i, s in enumerate(structures):
        if not isinstance(s, Mapping) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str) \
                or not isinstance(s.get("schema"), Mapping):
            raise ValueError(f"structures[{i}] must be {{'begin': str, 'schema': {{...}}, 'end': str}}")
        trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(f"structures[{i}].begin {s['begin']!r} starts with none of the triggers {triggers}")
        tags.append(llg.StructTag(trigger=trigger, begin=s["begin"], grammar=dict(s["schema"]), end=s["end"]))
    return tags


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a token bitmask."""
    return (vocab_size + 31) // 32


class GrammarMatcher:
    """One completion's position in its grammar: the tokens allowed next, and the tokens taken."""

    def __init__(self, matcher: Any):
        self._m = matcher

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into row `row` of an int32 bitmask [rows, width]."""
        self._m.unsafe_compute_mask_ptr(bitmask[row].ctypes.data, bitmask.shape[1] * 4)

    def consume(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it (the matcher is then
        in error and stays there)."""
        return bool(self._m.consume_token(token_id))

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar takes from here (none is consumed)."""
        return int(self._m.validate_tokens(list(tokens)))

    def fill_bitmasks(self, bitmask: np.ndarray, row: int, drafts: list[int]) -> None:
        """Rows `row` .. `row + len(drafts)`: the tokens allowed here, then after each draft in turn (for
        speculative decoding; the drafts are a `valid_prefix`). The matcher ends where it began."""
        self.fill_bitmask(bitmask, row)
        consumed = 0
        for j, tok in enumerate(drafts):
            if not self._m.is_stopped():  # a completed grammar takes only the end of sequence, unrecorded
                if not self._m.consume_token(tok):
                    raise RuntimeError(f"draft token {tok} is outside the grammar: {self._m.get_error()}")
                consumed += 1
            self.fill_bitmask(bitmask, row + 1 + j)
        if consumed and not self._m.rollback(consumed):
            raise RuntimeError(f"the grammar could not roll back {consumed} draft tokens: {self._m.get_error()}")

    @property
    def stopped(self) -> bool:
        """The grammar is complete and takes no further token."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str:
        return self._m.get_error() if self._m.is_error() else ""

    def copy(self) -> GrammarMatcher:
        return GrammarMatcher(self._m.deep_copy())


class AfterReasoning:
    """A grammar that holds once a reasoning model's answer begins (`StructuredOutputsParams.after_reasoning`),
    with the `GrammarMatcher` interface. States: "open" (a reply that may open with a start marker, as the
    tokens it encodes to: its first token is a start marker's first token, or the grammar's; once a marker's
    first tokens are written, `opened`, only its next tokens are allowed until it is whole: Granite's words),
    "reasoning" (every token allowed, until the text, `text(token)` joined, holds an end marker: as a parser
    reads it, whatever tokens wrote it), "answer" (the grammar's, from the token after the one that completed
    the end marker). Tokens before the answer never reach the grammar, so checking drafts copies nothing."""

    def __init__(self, inner: GrammarMatcher, starts: list[list[int]], ends: tuple[str, ...],
                 text: Callable[[int], str], state: str, tail: str = "", opened: tuple[int, ...] = ()):
        self._inner, self._starts, self._ends, self._text = inner, starts, ends, text
        self._state, self._tail, self._opened = state, tail, opened

    def _next_of_starts(self, opened: tuple[int, ...]) -> set[int]:
        """The tokens that continue a start marker whose first tokens are `opened`."""
        n = len(opened)
        return {m[n] for m in self._starts if len(m) > n and tuple(m[:n]) == opened}

    def _walk(self, tokens: list[int]) -> tuple[int | None, str, str, tuple[int, ...]]:
        """`tokens` read from here up to where the answer begins: (the index of the first token the grammar
        takes, None if none; the state, the reasoning's last tokens and the start marker's opened tokens there).
        A token that breaks off an opened start marker is where the tokens stop being valid (`valid_prefix`)."""
        state, tail, opened, longest = self._state, self._tail, self._opened, max(map(len, self._ends))
        for i, tok in enumerate(tokens):
            if state == "open":
                if tok not in self._next_of_starts(opened):
                    if opened:
                        return i, "broken", tail, opened
                    return i, "answer", "", ()
                opened = (*opened, tok)
                if list(opened) in self._starts:
                    state, opened = "reasoning", ()
                continue
            piece = self._text(tok)
            tail = (tail + piece)[-(longest + len(piece)):]  # (a marker may span tokens)
            if any(e in tail for e in self._ends):
                return i + 1, "answer", "", ()
        return None, state, tail, opened

    def _fill_open(self, bitmask: np.ndarray, row: int, opened: tuple[int, ...]) -> None:
        """The "open" state's row: the grammar's tokens or a start marker's first (nothing opened), else only
        the opened marker's next tokens."""
        if opened:
            bitmask[row] = 0
        else:
            self._inner.fill_bitmask(bitmask, row)
        words = bitmask[row].view(np.uint32)
        for tok in self._next_of_starts(opened):
            words[tok >> 5] |= np.uint32(1 << (tok & 31))

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        if self._state == "reasoning":
            bitmask[row] = -1
        elif self._state == "open":
            self._fill_open(bitmask, row, self._opened)
        else:
            self._inner.fill_bitmask(bitmask, row)

    def consume(self, token_id: int) -> bool:
        if self._state == "answer":
            return self._inner.consume(token_id)
        at, state, tail, opened = self._walk([token_id])
        if state == "broken":
            return False
        self._state, self._tail, self._opened = state, tail, opened
        return self._inner.consume(token_id) if at == 0 else True

    def valid_prefix(self, tokens: list[int]) -> int:
        if self._state == "answer":
            return self._inner.valid_prefix(tokens)
        at, state, _, _ = self._walk(tokens)
        if at is None or state == "broken":
            return len(tokens) if at is None else at
        return at + self._inner.valid_prefix(tokens[at:])

    def fill_bitmasks(self, bitmask: np.ndarray, row: int, drafts: list[int]) -> None:
        """Rows `row` .. `row + len(drafts)`: the reasoning's rows all allowed, the opening's its markers' (and at
        first the grammar's), the answer's its grammar's after the drafts before (`GrammarMatcher.fill_bitmasks`);
        nothing is consumed."""
        if self._state == "answer":
            self._inner.fill_bitmasks(bitmask, row, drafts)
            return
        state, tail, opened = self._state, self._tail, self._opened
        for k in range(len(drafts) + 1):
            if state == "open":
                self._fill_open(bitmask, row + k, opened)
            else:
                bitmask[row + k] = -1
            if k == len(drafts):
                return
            walker = AfterReasoning(self._inner, self._starts, self._ends, self._text, state, tail, opened)
            at, state, tail, opened = walker._walk([drafts[k]])
            if state == "broken":
                bitmask[row + k + 1:row + len(drafts) + 1] = -1  # (past a refused draft: nothing is taken)
                return
            if at is not None:  # the answer begins at draft k (the grammar's first token) or after it (an end)
                first = k + at
                self._inner.fill_bitmasks(bitmask, row + first, drafts[first:])
                if at == 0:  # (row k might still have opened a marker)
                    self._fill_open(bitmask, row + k, ())
                return

    @property
    def stopped(self) -> bool:
        return self._state == "answer" and self._inner.stopped

    @property
    def error(self) -> str:
        return self._inner.error

    def copy(self) -> AfterReasoning:
        return AfterReasoning(self._inner.copy(), self._starts, self._ends, self._text, self._state, self._tail,
                              self._opened)


def _last_marker_ends(text: str, starts: tuple[str, ...], ends: tuple[str, ...]) -> bool:
    """Whether the last reasoning marker in `text` is an end marker."""
    return max((text.rfind(m) for m in ends), default=-1) > max((text.rfind(m) for m in starts), default=-1)


# The prompt's last tokens read for its last reasoning marker (thinking switched off in the template).
_PROMPT_TAIL = 64


class GrammarCompiler:
    """Makes matchers over one model's tokenizer (its llguidance form is built on first use, ~0.4 s
    for SmolLM2's 49152 tokens)."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._ll_tokenizer = None
        self._lock = threading.Lock()
        # Each token's text, special tokens' included (the reasoning's end markers are read in it).
        self._token_text = functools.lru_cache(maxsize=1 << 16)(
            lambda token: tokenizer.decode([token], skip_special_tokens=False))

    def _ll(self):
        with self._lock:
            if self._ll_tokenizer is None:
                llg = _llguidance()
                try:
                    self._ll_tokenizer = llg.LLTokenizer(
                        self._tokenizer.backend.to_str(), n_vocab=self._vocab_size,
                        eos_token=list(self._tokenizer.eos_token_ids),
                    )
                except ValueError as e:  # llguidance reads byte-level BPE and SentencePiece-style decoders
                    raise ValueError(f"structured outputs are not available for this model's tokenizer: {e}") from e
            return self._ll_tokenizer

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher at the start of `params`' grammar; ValueError if it cannot be built."""
        llg = _llguidance()
        m = llg.LLMatcher(self._ll(), params.grammar_spec(), log_level=0)
        if m.is_error():
            raise ValueError(f"structured_outputs.{params.kind} is invalid: {m.get_error()}")
        return GrammarMatcher(m)

    def matcher_after(self, params: StructuredOutputsParams, prompt_ids: list[int]) -> GrammarMatcher | AfterReasoning:
        """`matcher(params)`, waiting for the answer when `params.after_reasoning` says how a reply reasons."""
        matcher = self.matcher(params)
        if params.after_reasoning is None:
            return matcher
        starts, ends, implicit = params.after_reasoning
        ends = tuple(m for m in ends if m)
        recent = self._tokenizer.decode(list(prompt_ids[-_PROMPT_TAIL:]), skip_special_tokens=False)
        if _last_marker_ends(recent, starts, ends):
            return matcher  # (thinking switched off: the answer begins at once)
        start_ids = [self._tokenizer.encode(m, add_special_tokens=False) for m in starts]
        return AfterReasoning(matcher, [m for m in start_ids if m], ends, self._token_text,
                              "reasoning" if implicit else "open")
