"""Unit tests of the server's request checking, response shaping and the fake engine (no HTTP)."""

from __future__ import annotations

import asyncio

import pytest

from jaxserve.outputs import CompletionOutput
from jaxserve.sampling_params import SamplingParams
from server.config import ServerConfig
from server.errors import ApiError
from server.fake_engine import WORDS, FakeAsyncEngine
from server.prompts import fit_to_context
from server.protocol import parse_chat, parse_completion
from server.responses import ChoiceCursor

MSG = [{"role": "user", "content": "hello"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}


def test_chat_maps_every_sampling_field():
    req = parse_chat({
        "model": "m", "messages": MSG, "n": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
        "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": -0.5, "seed": 7,
        "stop": "x", "stop_token_ids": [3], "ignore_eos": True, "max_completion_tokens": 9, "max_tokens": 4,
        "min_tokens": 2, "logprobs": True, "top_logprobs": 3, "skip_special_tokens": False,
        "include_stop_str_in_output": True, "priority": -1, "cache_salt": "s",
        "stream": True, "stream_options": {"include_usage": True}, "logit_bias": {"5": 7, "9": -250},
    })
    p = req.common.params
    assert p.logit_bias == {5: 7.0, 9: -100.0}, "ids from the JSON keys; biases clamped to [-100, 100]"
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (2, 0.5, 0.9, 5, 0.1)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty, p.seed) == (1.1, 0.5, -0.5, 7)
    assert p.stop == ["x"] and p.stop_token_ids == [3] and p.ignore_eos
    assert p.max_tokens == 9, "max_completion_tokens wins over max_tokens"
    assert (p.min_tokens, p.logprobs, p.skip_special_tokens, p.include_stop_str_in_output) == (2, 3, False, True)
    assert (req.common.priority, req.common.cache_salt, req.common.stream) == (-1, "s", True)
    assert req.common.stream_options.include_usage and req.logprobs


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("fields, expected", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}, {"json": SCHEMA}),
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"regex": "[0-9]+"}}, {"regex": "[0-9]+"}),
    ({"structured_outputs": {"choice": ["yes", "no"], "json": None}}, {"choice": ["yes", "no"]}),
    ({"structured_outputs": {"grammar": 'root ::= "a" | "b"'}}, {"grammar": 'root ::= "a" | "b"'}),
    ({"guided_choice": ["x", "y"]}, {"choice": ["x", "y"]}),
    ({"guided_json": SCHEMA}, {"json": SCHEMA}),
])
def test_output_constraints_map_to_structured_outputs(fields, expected):
    for parse, body in ((parse_chat, {"messages": MSG}), (parse_completion, {"prompt": "p"})):
        so = parse({**body, **fields}).common.params.structured_outputs
        if expected is None:
            assert so is None
        else:
            assert {k: v for k, v in vars(so).items() if v is not None} == expected


def test_tool_choice_becomes_an_output_constraint():
    bare = {"type": "function", "function": {"name": "now"}}
    named = parse_chat({"messages": MSG, "tools": [TOOL, bare],
                        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert named.tool_choice.name == "get_weather"
    assert named.common.params.structured_outputs.json == TOOL["function"]["parameters"]
    assert named.tools[1]["function"]["parameters"] == {"type": "object", "properties": {}}, "no parameters: none"
    required = parse_chat({"messages": MSG, "tools": [TOOL, bare], "tool_choice": "required"})
    schema = required.common.params.structured_outputs.json
    assert required.tool_choice.mode == "required" and schema["type"] == "array" and schema["minItems"] == 1
    assert [c["properties"]["name"]["enum"] for c in schema["items"]["anyOf"]] == [["get_weather"], ["now"]]
    assert "maxItems" not in schema
    one = parse_chat({"messages": MSG, "tools": [TOOL, bare], "tool_choice": "required", "parallel_tool_calls": False})
    assert one.common.params.structured_outputs.json["maxItems"] == 1, "no parallel calls: exactly one"
    shown = parse_chat({"messages": MSG, "tools": [TOOL], "tool_choice": "none"})
    assert shown.tools == [TOOL] and shown.tool_choice is None and shown.common.params.structured_outputs is None
    assert parse_chat({"messages": MSG, "tools": [], "tool_choice": "none"}).tools is None
    for body in ({}, {"tool_choice": "auto"}):  # "auto", the default with tools: no constraint, parsed after
        auto = parse_chat({"messages": MSG, "tools": [TOOL], **body})
        assert auto.tool_choice.mode == "auto" and auto.tool_choice.parallel
        assert not auto.tool_choice.forced and auto.common.params.structured_outputs is None
    single = parse_chat({"messages": MSG, "tools": [TOOL], "parallel_tool_calls": False})
    assert single.tool_choice.mode == "auto" and not single.tool_choice.parallel


def test_prompt_logprobs_fields():
    echo = parse_completion({"prompt": "p", "echo": True, "logprobs": 2})
    assert echo.common.params.prompt_logprobs == 2 and echo.common.prompt_logprobs is None
    both = parse_completion({"prompt": "p", "echo": True, "logprobs": 2, "prompt_logprobs": 5})
    assert both.common.params.prompt_logprobs == 5 and both.common.prompt_logprobs == 5
    assert parse_completion({"prompt": "p", "logprobs": 2}).common.params.prompt_logprobs is None
    chat = parse_chat({"messages": MSG, "prompt_logprobs": 0})
    assert chat.common.params.prompt_logprobs == 0 and chat.common.prompt_logprobs == 0


def test_chat_defaults_follow_openai():
    req = parse_chat({"messages": MSG})
    p = req.common.params
    assert p.temperature == 1.0 and p.max_tokens is None and p.logprobs is None and p.n == 1
    assert not req.common.max_tokens_given and req.add_generation_prompt


def test_completion_prompt_forms_and_defaults():
    assert parse_completion({"prompt": "hi"}).prompts == ["hi"]
    assert parse_completion({"prompt": [1, 2]}).prompts == [[1, 2]]
    assert parse_completion({"prompt": ["a", [3]]}).prompts == ["a", [3]]
    req = parse_completion({"prompt": "hi", "logprobs": 0})
    assert req.common.params.max_tokens == 16 and req.common.params.logprobs == 0


@pytest.mark.parametrize("body, param", [
    ({"messages": MSG, "temperature": "hot"}, "temperature"),
    ({"messages": MSG, "temperature": -1}, "temperature"),
    ({"messages": MSG, "top_p": 0}, "top_p"),
    ({"messages": MSG, "n": 0}, "n"),
    ({"messages": MSG, "n": True}, "n"),
    ({"messages": MSG, "max_tokens": 0}, "max_tokens"),
    ({"messages": MSG, "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ({"messages": MSG, "stop": ["a", 3]}, "stop"),
    ({"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": MSG, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": MSG, "logit_bias": [1, 2]}, "logit_bias"),
    ({"messages": MSG, "logit_bias": {"-1": 2}}, "logit_bias"),
    ({"messages": MSG, "logit_bias": {"1": float("nan")}}, "logit_bias"),
    ({"messages": MSG, "response_format": {"type": "json_schema"}}, "response_format"),
    ({"messages": MSG, "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": MSG, "response_format": "json"}, "response_format"),
    ({"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "wat"}}}},
     "response_format"),
    ({"messages": MSG, "structured_outputs": {"regex": "(a"}}, "structured_outputs"),
    ({"messages": MSG, "structured_outputs": {"choice": "yes"}}, "structured_outputs"),
    ({"messages": MSG, "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"messages": MSG, "structured_outputs": {"xml": "<a/>"}}, "structured_outputs"),
    ({"messages": MSG, "guided_grammar": "start: foo"}, "guided_grammar"),
    ({"messages": MSG, "guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": MSG, "tools": [{"type": "function"}]}, "tools[0]"),
    ({"messages": MSG, "tools": [TOOL], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"messages": MSG, "tools": {"f": 1}, "tool_choice": "required"}, "tools"),
    ({"messages": MSG, "tools": [TOOL, {"type": "retrieval"}], "tool_choice": "required"}, "tools[1]"),
    ({"messages": MSG, "tools": [TOOL, TOOL], "tool_choice": "required"}, "tools[1].function.name"),
    ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "none"},
     "tools[0].function.name"),
    ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}],
      "tool_choice": "required"}, "tools"),
    ({"messages": MSG, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"messages": MSG, "tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": MSG, "tool_choice": "required"}, "tool_choice"),
    ({"messages": MSG, "tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].image_url"),
    ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {}}]}]},
     "messages[0].content[0].video_url"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": "x"}]}]},
     "messages[0].content[0].type"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"messages": MSG, "prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
])
def test_bad_fields_are_named(body, param):
    parse = parse_chat if "messages" in body else parse_completion
    with pytest.raises(ApiError) as info:
        parse(body)
    assert info.value.status == 400 and info.value.param == param, info.value.message


def test_fit_to_context_fills_the_room_or_names_the_numbers():
    p = SamplingParams(max_tokens=None)
    assert fit_to_context(10, [1, 2, 3], p, max_tokens_given=False, prompt_param="prompt").max_tokens == 7
    # A default (not client-given) max_tokens larger than the room is clamped, not refused.
    assert fit_to_context(10, [1] * 8, SamplingParams(max_tokens=16), max_tokens_given=False,
                          prompt_param="prompt").max_tokens == 2
    with pytest.raises(ApiError) as info:
        fit_to_context(10, [1] * 8, SamplingParams(max_tokens=5), max_tokens_given=True, prompt_param="prompt")
    assert info.value.param == "max_tokens" and "13" in info.value.message and "10" in info.value.message
    with pytest.raises(ApiError) as info:
        fit_to_context(10, [1] * 10, p, max_tokens_given=False, prompt_param="messages")
    assert info.value.param == "messages" and info.value.code == "context_length_exceeded"


def test_choice_cursor_emits_only_what_is_new():
    cur = ChoiceCursor()
    d = cur.advance(CompletionOutput(0, "one", [3], None, None))
    assert d.text == "one" and d.finish_reason is None
    assert cur.advance(CompletionOutput(0, "one", [3], None, None)) is None
    d = cur.advance(CompletionOutput(0, "one two", [3, 4, 2], None, None, "stop"))
    assert d.text == " two" and d.finish_reason == "stop"
    assert cur.advance(CompletionOutput(0, "one two", [3, 4, 2], None, None, "stop")) is None


def test_server_config_checks():
    with pytest.raises(ValueError, match="port"):
        ServerConfig(port=70000)
    with pytest.raises(ValueError, match="max_waiting_requests"):
        ServerConfig(max_waiting_requests=0)
    assert ServerConfig(served_model_names=["a", "b"]).served_model_names == ("a", "b")


def _run(engine, prompt, params, rid="r"):
    async def go():
        return [out async for out in engine.generate(prompt, params, rid)]

    return asyncio.run(go())


def test_fake_engine_outputs_are_the_documented_words():
    eng = FakeAsyncEngine(step_delay=0)
    try:
        outs = _run(eng, "hello", SamplingParams(temperature=0, max_tokens=3, n=2, logprobs=1))
        last = outs[-1]
        assert last.finished and [c.text for c in last.outputs] == ["one two three", "two three four"]
        assert all(c.finish_reason == "length" for c in last.outputs)
        assert [o.outputs[0].text for o in outs] == ["one", "one two", "one two three"]
        assert last.outputs[0].logprobs[1][last.outputs[0].token_ids[1]].logprob == -0.25
        full = _run(eng, "hello", SamplingParams(temperature=0, max_tokens=100))[-1].outputs[0]
        assert full.text == " ".join(WORDS) and full.finish_reason == "stop" and len(full.token_ids) == 17
        assert _run(eng, "hello", SamplingParams(temperature=0, max_tokens=100))[-1].metrics.num_cached_tokens == 0
        stop = _run(eng, "hello", SamplingParams(temperature=0, stop=["three f"], max_tokens=10))
        assert [o.outputs[0].text for o in stop][-1] == "one two "
        assert all("three" not in o.outputs[0].text for o in stop), "a possible stop string is held back"
        with pytest.raises(ValueError, match="256"):
            _run(eng, "hello", SamplingParams(max_tokens=256))
    finally:
        eng.shutdown()


def test_tools_reach_the_chat_template():
    from server.fake_engine import fake_tokenizer
    from server.prompts import chat_prompt

    tok = fake_tokenizer()
    tok.chat_templates["tool_use"] = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
                                      "{% for m in messages %}{{ m.content }}{% endfor %}")
    text, _, _ = chat_prompt(tok, parse_chat({"messages": MSG, "tools": [TOOL], "tool_choice": "none"}), None)
    assert text == "[get_weather]hello"
    text, _, _ = chat_prompt(tok, parse_chat({"messages": MSG}), None)
    assert "[get_weather]" not in text, "without tools the default template renders"
    # The server's --chat-template replaces the model's, tools or not.
    text, _, _ = chat_prompt(tok, parse_chat({"messages": MSG, "tools": [TOOL]}), "<{{ messages[0].content }}>")
    assert text == "<hello>"


def test_tool_call_arguments_reach_templates_as_objects():
    """An assistant turn's tool calls come back from clients with `arguments` as JSON text; templates
    get the object (as transformers documents), and text that is not JSON is left as it came."""
    from jaxserve.chat_template import render_chat_template

    template = ("{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.name }}:"
                "{{ c.function.arguments.city if c.function.arguments is mapping else c.function.arguments }};"
                "{% endfor %}{% endfor %}")
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
             {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    assert render_chat_template(template, messages) == "get_weather:Oslo;g:not json;"
    assert calls[0]["function"]["arguments"] == '{"city": "Oslo"}', "the caller's messages are not changed"
