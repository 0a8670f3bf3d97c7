"""SamplingParams: defaults, normalization and the validation messages."""

import dataclasses
import json
import re

import pytest

from jaxserve.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams
from jaxserve.structured_outputs import StructuredOutputsParams

BAD = [
    (dict(n=0), "n must be at least 1, got 0"),
    (dict(n=1.5), "n must be an integer"),
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0"),
    (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
    (dict(top_k=-2), "top_k must be -1 or 0 (disabled) or at least 1, got -2"),
    (dict(top_k=True), "top_k must be an integer"),
    (dict(min_p=-0.1), "min_p must be in [0, 1], got -0.1"),
    (dict(min_p=1.1), "min_p must be in [0, 1], got 1.1"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0, got 0.0"),
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2], got 2.5"),
    (dict(frequency_penalty=-3), "frequency_penalty must be in [-2, 2], got -3"),
    (dict(seed="7"), "seed must be an integer"),
    (dict(stop=["ok", ""]), "stop must not contain an empty string"),
    (dict(stop=[3]), "stop must be a string or a list of strings"),
    (dict(stop_token_ids=[-1]), "stop_token_ids must be >= 0, got -1"),
    (dict(max_tokens=0), "max_tokens must be at least 1 (or None), got 0"),
    (dict(min_tokens=-1), "min_tokens must be >= 0, got -1"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens must be <= max_tokens (10), got 20"),
    (dict(logprobs=-1), f"logprobs must be in [0, {MAX_LOGPROBS}] (or None), got -1"),
    (dict(logprobs=MAX_LOGPROBS + 1), f"logprobs must be in [0, {MAX_LOGPROBS}] (or None), got 21"),
    (dict(prompt_logprobs=21), "prompt_logprobs must be in"),
    (dict(prompt_logprobs=True), "prompt_logprobs must be an integer"),
    (dict(logit_bias=[(1, 2.0)]), "logit_bias must be a mapping of token ids to biases"),
    (dict(logit_bias={"5": 1.0}), "logit_bias token id must be an integer, got '5'"),
    (dict(logit_bias={True: 1.0}), "logit_bias token id must be an integer, got True"),
    (dict(logit_bias={-3: 1.0}), "logit_bias token id must be >= 0, got -3"),
    (dict(logit_bias={3: float("inf")}), "logit_bias[3] must be a finite number, got inf"),
    (dict(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}),
     f"logit_bias has {MAX_LOGIT_BIAS + 1} entries; at most {MAX_LOGIT_BIAS} are supported"),
]


@pytest.mark.parametrize("kwargs,message", BAD, ids=[str(k) for k, _ in BAD])
def test_bad_values_name_the_field_and_range(kwargs, message):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert message in str(info.value)


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert p.max_tokens == 16 and p.min_tokens == 0 and p.logprobs is None
    assert p.stop == [] and p.stop_token_ids == [] and p.skip_special_tokens
    assert not p.is_greedy


def test_edges_of_the_ranges_are_accepted():
    SamplingParams(
        temperature=0,
        top_p=1.0,
        top_k=1,
        min_p=1.0,
        repetition_penalty=1e-3,
        presence_penalty=-2,
        frequency_penalty=2,
        logprobs=0,
        max_tokens=None,
        min_tokens=5,
    )
    SamplingParams(logprobs=MAX_LOGPROBS, min_tokens=3, max_tokens=3, seed=-5)


def test_normalization():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(5, 6)).stop_token_ids == [5, 6]
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams().logit_bias == {}
    assert SamplingParams(logit_bias={7: 3, 8: -250.5, 9: 101}).logit_bias == {7: 3.0, 8: -100.0, 9: 100.0}


def test_greedy_threshold():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-3).is_greedy


def test_stop_token_ids_include_eos_unless_ignored():
    p = SamplingParams(stop_token_ids=[7, 2])
    assert p.all_stop_token_ids([2, 9]) == [7, 2, 9]
    assert SamplingParams(stop_token_ids=[7], ignore_eos=True).all_stop_token_ids([2]) == [7]


def test_frozen_and_replace_revalidates():
    p = SamplingParams(temperature=0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 1.0  # type: ignore[misc]
    assert dataclasses.replace(p, seed=3).seed == 3
    with pytest.raises(ValueError, match="top_p"):
        dataclasses.replace(p, top_p=2.0)


@pytest.mark.parametrize("fields, message", [
    ({}, "exactly one of json, regex, choice, grammar, json_object, structural_tag; got none"),
    ({"regex": "a", "choice": ["b"]}, "got regex, choice"),
    ({"choice": "yes"}, "choice must be a non-empty list of strings"),
    ({"choice": []}, "choice must be a non-empty list of strings"),
    ({"choice": ["a", 1]}, "choice must be a non-empty list of strings"),
    ({"regex": 5}, "regex must be a string"),
    ({"json": [1]}, "json must be a JSON schema object"),
    ({"json": "{not json"}, "structured_outputs.json is invalid"),
    ({"json": {"type": "object", "properties": {"a": {"type": "wat"}}}}, "structured_outputs.json is invalid"),
    ({"json_object": False}, "exactly one"),
    ({"regex": "[a-"}, "structured_outputs.regex is invalid"),
    ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar is invalid"),
    ({"grammar": "root ::= ("}, "structured_outputs.grammar is invalid"),
    ({"structural_tag": [1]}, "structural_tag must be a JSON object"),
    ({"structural_tag": {"structures": [], "triggers": ["<f"]}}, "'structures' must be a non-empty list"),
    ({"structural_tag": {"structures": [{"begin": "<f=a>", "schema": {}, "end": "</f>"}], "triggers": []}},
     "'triggers' must be a non-empty list"),
    ({"structural_tag": {"structures": [{"begin": "<g=a>", "schema": {}, "end": "</g>"}], "triggers": ["<f"]}},
     "structures[0].begin '<g=a>' starts with none of the triggers ['<f']"),
    ({"structural_tag": {"structures": [{"begin": "<f=a>", "end": "</f>"}], "triggers": ["<f"]}},
     "structures[0] must be {'begin': str, 'schema': {...}, 'end': str}"),
    ({"structural_tag": {"structures": [{"begin": "<f=a>", "schema": {"type": "wat"}, "end": "</f>"}],
                         "triggers": ["<f"]}}, "structured_outputs.structural_tag is invalid"),
])
def test_structured_outputs_name_what_is_wrong(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutputsParams(**fields)


def test_structured_outputs_forms():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    from_text = StructuredOutputsParams(json='{"type": "object", "properties": {"a": {"type": "integer"}}}')
    assert from_text.grammar_spec() == StructuredOutputsParams(json=schema).grammar_spec()
    p = SamplingParams(structured_outputs={"choice": ("yes", "no")})
    assert p.structured_outputs == StructuredOutputsParams(choice=["yes", "no"]) and p.structured_outputs.kind == "choice"
    for grammar in ('start: "a" | "b"', 'root ::= "a" | "b"'):  # Lark and GBNF
        assert StructuredOutputsParams(grammar=grammar).kind == "grammar"
    with pytest.raises(ValueError, match="must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs="json")


def test_command_line_constraints(tmp_path):
    from jaxserve import cli

    def params(*flags):
        return cli._sampling_params(cli.build_parser().parse_args(["generate", "hi", *flags]))

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    assert params("--json-schema", str(path)).structured_outputs.json == schema
    assert params("--json-schema", json.dumps(schema)).structured_outputs.json == schema
    assert params("--regex", "[0-9]+").structured_outputs.regex == "[0-9]+"
    assert params("--choice", "yes", "--choice", "no").structured_outputs.choice == ["yes", "no"]
    assert params().structured_outputs is None
    with pytest.raises(SystemExit, match="neither a file nor JSON"):
        params("--json-schema", "{nope")
    with pytest.raises(SystemExit):  # argparse: only one constraint
        params("--regex", "a", "--choice", "b")
