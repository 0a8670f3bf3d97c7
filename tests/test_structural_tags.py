"""Structural tags (vLLM's `structural_tag` constraint): free text in which every tool call the model begins
with a trigger must be one of the given structures: its begin, JSON of its schema, its end. Checked on the
bundled model's tokenizer through the grammar matcher the engine masks with, and from a request's JSON."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.structured_outputs import GrammarCompiler, StructuredOutputsParams, bitmask_width
from jaxserve.tokenizer import Tokenizer
from server.constraints import structured_outputs

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}
TAG = {"structures": [{"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"},
                      {"begin": "<function=get_time>", "schema": {"type": "object", "properties": {}}, "end": "</function>"}],
       "triggers": ["<function="]}


@pytest.fixture(scope="module")
def tokenizer(smollm_path):
    return Tokenizer.from_gguf(smollm_path)


@pytest.fixture(scope="module")
def matcher_of(tokenizer):
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)

    def taken(text: str) -> tuple[int, int]:
        """(tokens the constraint takes, tokens) of `text` from the start of the output."""
        ids = tokenizer.encode(text, add_special_tokens=False)
        return compiler.matcher(StructuredOutputsParams(structural_tag=TAG)).valid_prefix(ids), len(ids)

    return taken


@pytest.mark.parametrize("text", [
    "No tool is needed: it is sunny.",
    'Let me check. <function=get_weather>{"city": "Paris"}</function> It is 20 degrees.',
    '<function=get_time>{}</function><function=get_weather>{"city": "Oslo"}</function>',
])
def test_free_text_and_calls_that_follow_their_structure_are_taken(matcher_of, text):
    taken, total = matcher_of(text)
    assert taken == total


@pytest.mark.parametrize("text", [
    '<function=get_weather>{"town": "Paris"}</function>',  # not the tool's parameters
    '<function=get_weather>Paris</function>',  # not JSON
    '<function=get_news>{}</function>',  # after the trigger, only a structure's begin
    '<function=get_weather>{"city": "Paris"} and more',  # the structure's end must follow
])
def test_a_call_that_breaks_its_structure_is_cut(matcher_of, text):
    taken, total = matcher_of(text)
    assert taken < total


@pytest.mark.parametrize("text,may_end", [("It is sunny.", True),
                                          ('<function=get_weather>{"city": "Oslo"}</function>', True),
                                          ('Let me check. <function=get_weather>{"city": ', False)])
def test_the_output_may_end_in_free_text_not_inside_a_call(tokenizer, text, may_end):
    matcher = GrammarCompiler(tokenizer, tokenizer.vocab_size).matcher(StructuredOutputsParams(structural_tag=TAG))
    for token in tokenizer.encode(text, add_special_tokens=False):
        assert matcher.consume(token)
    mask = np.zeros((1, bitmask_width(tokenizer.vocab_size)), np.int32)
    matcher.fill_bitmask(mask, 0)
    eos = next(iter(tokenizer.eos_token_ids))
    assert bool((mask[0, eos // 32] >> (eos % 32)) & 1) is may_end


def test_requests_name_structural_tags_as_vllm_does():
    by_format = structured_outputs({"response_format": {"type": "structural_tag", **TAG}})
    assert by_format == StructuredOutputsParams(structural_tag=TAG) and by_format.kind == "structural_tag"
    assert structured_outputs({"structured_outputs": {"structural_tag": TAG}}) == by_format
    from server.errors import ApiError

    with pytest.raises(ApiError, match="starts with none of the triggers"):
        structured_outputs({"response_format": {"type": "structural_tag", "structures": TAG["structures"],
                                                "triggers": ["<tool"]}})
