"""An output constraint that holds from where a reasoning model's answer begins (vLLM applies one after the
reasoning): the grammar matcher the engine masks with waits for the end of the thoughts (an end marker of one
or several tokens), or, where a reply may open without thinking, tells at its first token; the server sets it
from its reasoning parser for chat requests, forced tool calls included. On the bundled model's tokenizer, with
markers it writes as several tokens."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.sampling_params import SamplingParams
from jaxserve.structured_outputs import (
    AfterReasoning,
    GrammarCompiler,
    StructuredOutputsParams,
    bitmask_width,
)
from jaxserve.tokenizer import Tokenizer
from server.reasoning import constrained_throughout, reasoning_params, reasoning_parser

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
THINK = (("<|im_start|>",), ("</think>",))  # a start marker of one token, an end marker of several


@pytest.fixture(scope="module")
def tokenizer(smollm_path):
    return Tokenizer.from_gguf(smollm_path)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, tokenizer.vocab_size)


def _taken(compiler, tokenizer, text: str, implicit: bool, prompt: str = "") -> str:
    """How many of `text`'s tokens the constraint takes from the start of the reply: "all", "none" or "some"."""
    params = StructuredOutputsParams(json=SCHEMA, after_reasoning=(*THINK, implicit))
    matcher = compiler.matcher_after(params, tokenizer.encode(prompt, add_special_tokens=False))
    ids = tokenizer.encode(text, add_special_tokens=False)
    taken = matcher.valid_prefix(ids)
    return "all" if taken == len(ids) else "none" if taken == 0 else "some"


@pytest.mark.parametrize("text,implicit,taken", [
    ('Some thoughts, {not json} at all.</think>{"a": 1}', True, "all"),  # thoughts free, then the schema
    ('Thinking</think>{"b": 1}', True, "some"),  # the answer breaks the schema: cut within it
    ('<|im_start|>free {thoughts}</think>{"a": 2}', False, "all"),  # opened with the start marker
    ('{"a": 3}', False, "all"),  # opened without it: the answer at once
    ("Plain words", False, "none"),  # not the answer's JSON, not the start marker
])
def test_the_constraint_holds_from_the_answer(compiler, tokenizer, text, implicit, taken):
    assert _taken(compiler, tokenizer, text, implicit) == taken


def test_a_prompt_ending_its_thoughts_starts_with_the_answer(compiler, tokenizer):
    """Thinking switched off in the chat template (the prompt ends with an empty thought): the constraint holds
    from the first token; a prompt whose last marker starts a thought leaves the reply free until it ends."""
    ended = "<|im_start|>assistant\n<|im_start|></think>"
    assert _taken(compiler, tokenizer, "free words", True, prompt=ended) == "none"
    assert _taken(compiler, tokenizer, "free words", True, prompt="</think> then <|im_start|>") == "all"


def test_the_first_mask_allows_the_start_marker_or_the_answer(compiler, tokenizer):
    params = StructuredOutputsParams(json=SCHEMA, after_reasoning=(*THINK, False))
    matcher = compiler.matcher_after(params, [])
    assert isinstance(matcher, AfterReasoning)
    mask = np.zeros((3, bitmask_width(tokenizer.vocab_size)), np.int32)
    drafts = tokenizer.encode("<|im_start|>x", add_special_tokens=False)
    matcher.fill_bitmasks(mask, 0, drafts)
    allowed = [{t for t in range(tokenizer.vocab_size) if (row[t >> 5] >> (t & 31)) & 1} for row in mask]
    start, brace = drafts[0], tokenizer.encode("{", add_special_tokens=False)[0]
    assert start in allowed[0] and brace in allowed[0] and len(allowed[0]) < 1000  # the marker, or JSON's start
    assert len(allowed[1]) == len(allowed[2]) == tokenizer.vocab_size  # thinking: all free
    assert matcher.valid_prefix(drafts) == 2  # (the drafts consumed nothing)


def test_drafts_across_the_end_of_the_thoughts(compiler, tokenizer):
    """Speculative drafts checked in one step: rows up to the end marker's last token all allowed, the rows after
    it the grammar's after the drafts before them; a draft breaking the answer cuts the prefix there; nothing is
    consumed, and the grammar sees none of the thoughts."""
    params = StructuredOutputsParams(json=SCHEMA, after_reasoning=((), ("</think>",), True))
    matcher = compiler.matcher_after(params, [])
    thoughts, answer = (tokenizer.encode(t, add_special_tokens=False) for t in ("ok.</think>", '{"'))
    drafts = thoughts + answer
    mask = np.zeros((len(drafts) + 1, bitmask_width(tokenizer.vocab_size)), np.int32)
    matcher.fill_bitmasks(mask, 0, drafts)
    counts = [int(np.unpackbits(row.view(np.uint8)).sum()) for row in mask]
    assert counts[:len(thoughts)] == [tokenizer.vocab_size] * len(thoughts)
    assert all(c < 1000 for c in counts[len(thoughts):])  # the JSON's openings, then its key's
    assert (mask[len(thoughts), answer[0] >> 5] >> (answer[0] & 31)) & 1  # "{" may open the answer
    assert matcher.valid_prefix(drafts) == len(drafts)
    bad = thoughts + tokenizer.encode("Paris", add_special_tokens=False)
    assert matcher.valid_prefix(bad) == len(thoughts)
    rest = tokenizer.encode('a": 1}', add_special_tokens=False)
    for tok in drafts + rest:  # taken one by one: the answer's tokens are the grammar's, which completes
        assert not matcher.stopped and matcher.consume(tok)
    assert matcher.stopped


def test_a_start_marker_of_several_tokens_leaves_the_constraint_throughout(compiler, tokenizer):
    """SmolLM2 writes "<think>" as several tokens: the first step could not tell it from an answer."""
    assert len(tokenizer.encode("<think>", add_special_tokens=False)) > 1
    params = StructuredOutputsParams(json=SCHEMA, after_reasoning=(("<think>",), ("</think>",), False))
    assert not isinstance(compiler.matcher_after(params, []), AfterReasoning)


def test_the_server_defers_a_chat_constraint_to_the_answer():
    so = StructuredOutputsParams(json=SCHEMA)
    params = SamplingParams(structured_outputs=so)
    qwen3, granite = reasoning_parser("qwen3"), reasoning_parser("granite")
    assert reasoning_params(qwen3, params).structured_outputs.after_reasoning == (("<think>",), ("</think>",), False)
    assert reasoning_params(reasoning_parser("deepseek_r1"), params).structured_outputs.after_reasoning[2]
    gptoss = reasoning_params(reasoning_parser("openai_gptoss"), params)
    assert gptoss.structured_outputs.after_reasoning == ((), ("<|channel|>final<|message|>",), True)
    assert not gptoss.skip_special_tokens  # (the harmony markers stay in the text for its parser)
    # Under a parser whose start the engine cannot tell, or none, the constraint holds throughout (forced tool
    # calls take the same parameters: tests/test_reasoning.py).
    for parser in (granite, None):
        assert reasoning_params(parser, params).structured_outputs.after_reasoning is None

    class Chat:  # (the fields `constrained_throughout` reads)
        messages, common, tool_choice = [], type("Common", (), {"params": params}), None

    class Completion:
        common = Chat.common

    assert not constrained_throughout(qwen3, Chat) and constrained_throughout(granite, Chat)
    assert constrained_throughout(qwen3, Completion)
