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


GRANITE = (("Here is my thought process:", "Here's my thought process:"), ("Here is my response:",
                                                                         "Here's my response:"))


@pytest.mark.parametrize("text,taken", [
    ('Here is my thought process: {free} words. Here is my response:{"a": 1}', "all"),
    ("Here's my thought process:\nhmm\nHere's my response:{\"a\": 2}", "all"),
    ("Here's my thought process: hmm. Here's my response:\n{}", "some"),  # (JSON takes no newline first)
    ('{"a": 3}', "all"),  # opened without a marker: the answer at once
    ("Here is my answer", "some"),  # a marker's first words, then off it: cut where it leaves the marker
    ("Plain words", "none"),
])
def test_start_markers_of_several_tokens(compiler, tokenizer, text, taken):
    """Granite's words: a reply opening with a start marker's first tokens must write the whole marker, then
    thinks freely until an end marker; one opening otherwise is the answer."""
    assert all(len(tokenizer.encode(m, add_special_tokens=False)) > 1 for m in GRANITE[0])
    params = StructuredOutputsParams(json=SCHEMA, after_reasoning=(*GRANITE, False))
    matcher = compiler.matcher_after(params, [])
    assert isinstance(matcher, AfterReasoning)
    ids = tokenizer.encode(text, add_special_tokens=False)
    got = matcher.valid_prefix(ids)
    assert ("all" if got == len(ids) else "none" if got == 0 else "some") == taken
    if taken == "all":  # one by one, as the engine consumes them: the grammar completes
        for tok in ids:
            assert matcher.consume(tok)
        assert matcher.stopped


def test_masks_while_a_start_marker_of_several_tokens_opens(compiler, tokenizer):
    """First row: the grammar's openings or the markers' first token ("Here"); while a marker is opened, only
    its next tokens (both markers' after "Here", then one); after it, everything; drafts checked in one step
    see the same masks, and a draft leaving the marker is refused."""
    params = StructuredOutputsParams(json=SCHEMA, after_reasoning=(*GRANITE, False))
    matcher = compiler.matcher_after(params, [])
    marker = tokenizer.encode(GRANITE[0][0], add_special_tokens=False)
    other = tokenizer.encode(GRANITE[0][1], add_special_tokens=False)
    drafts = marker + tokenizer.encode(" x", add_special_tokens=False)
    mask = np.zeros((len(drafts) + 1, bitmask_width(tokenizer.vocab_size)), np.int32)
    matcher.fill_bitmasks(mask, 0, drafts)
    allowed = [{t for t in range(tokenizer.vocab_size) if (row[t >> 5] >> (t & 31)) & 1} for row in mask]
    brace = tokenizer.encode("{", add_special_tokens=False)[0]
    assert marker[0] == other[0] and {marker[0], brace} <= allowed[0] and len(allowed[0]) < 1000
    assert allowed[1] == {marker[1], other[1]}
    assert all(allowed[k] == {marker[k]} for k in range(2, len(marker)))
    assert all(len(allowed[k]) == tokenizer.vocab_size for k in range(len(marker), len(drafts) + 1))
    single = np.zeros((1, mask.shape[1]), np.int32)
    for k, tok in enumerate(drafts):  # one token at a time: the same masks
        matcher.fill_bitmask(single, 0)
        np.testing.assert_array_equal(single[0], mask[k])
        assert matcher.consume(tok)
    fresh = compiler.matcher_after(params, [])
    off = marker[:2] + tokenizer.encode(" answer", add_special_tokens=False)
    assert fresh.valid_prefix(off) == 2 and fresh.consume(off[0]) and fresh.consume(off[1])
    assert not fresh.consume(off[2])


def test_the_server_defers_a_chat_constraint_to_the_answer():
    so = StructuredOutputsParams(json=SCHEMA)
    params = SamplingParams(structured_outputs=so)
    qwen3, granite = reasoning_parser("qwen3"), reasoning_parser("granite")
    assert reasoning_params(qwen3, params).structured_outputs.after_reasoning == (("<think>",), ("</think>",), False)
    assert reasoning_params(reasoning_parser("deepseek_r1"), params).structured_outputs.after_reasoning[2]
    gptoss = reasoning_params(reasoning_parser("openai_gptoss"), params)
    assert gptoss.structured_outputs.after_reasoning == ((), ("<|channel|>final<|message|>",), True)
    assert not gptoss.skip_special_tokens  # (the harmony markers stay in the text for its parser)
    # Granite's words too (told as they open: test_start_markers_of_several_tokens); without a parser the
    # constraint holds throughout (forced tool calls take the same parameters: tests/test_reasoning.py).
    assert reasoning_params(granite, params).structured_outputs.after_reasoning == (*GRANITE, False)
    assert reasoning_params(None, params).structured_outputs.after_reasoning is None

    class Chat:  # (the fields `constrained_throughout` reads)
        messages, common, tool_choice = [], type("Common", (), {"params": params}), None

    class Completion:
        common = Chat.common

    assert not constrained_throughout(qwen3, Chat) and not constrained_throughout(granite, Chat)
    assert constrained_throughout(None, Chat)
    assert constrained_throughout(qwen3, Completion)
