"""Reasoning parsers: a thinking model's reasoning apart from its answer, whole and streamed, and over
HTTP (the fake engine with scripted replies, with the hermes tool-call parser after the reasoning)."""

from __future__ import annotations

import json

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.config import ServerConfig
from server.fake_engine import FakeAsyncEngine
from server.reasoning import REASONING_PARSERS, reasoning_parser
from server.runner import serve_in_thread

CASES = [
    ("deepseek_r1", "<think>\nIs 9.11 < 9.8? Yes.\n</think>\n\n9.8 is greater.", "\nIs 9.11 < 9.8? Yes.\n",
     "9.8 is greater."),
    ("deepseek_r1", "The prompt opened the thought.\n</think>\n\nAnswer.", "The prompt opened the thought.\n",
     "Answer."),
    ("deepseek_r1", "Still thinking when cut", "Still thinking when cut", ""),
    ("kimi_k2", "<think>Need the weather.</think>Calling it.", "Need the weather.", "Calling it."),
    ("kimi_k2", "Need the weather.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0",
     "Need the weather.", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"),
    ("kimi_k2", "Still thinking <|tool_calls_sec", "Still thinking <|tool_calls_sec", ""),
    ("apertus", "<|inner_prefix|>Short.<|inner_suffix|>Answer.", "Short.", "Answer."),
    ("apertus", "A direct answer.", None, "A direct answer."),
    ("olmo3", "The template opened <think>; so 2 + 2 = 4.</think>\n\nFour.", "The template opened <think>; so 2 + 2 = 4.",
     "Four."),
    ("deepseek_r1", "  <think></think>Direct.", "", "Direct."),
    ("deepseek_r1", "<think>a < b, and </thin is not the end</think>x", "a < b, and </thin is not the end", "x"),
    ("qwen3", "<think>\nok\n</think>\n\nAnswer", "\nok\n", "Answer"),
    ("qwen3", "An answer with </think> inside", None, "An answer with </think> inside"),
    ("qwen3", "<thi", None, "<thi"),
    ("qwen3", "<think>cut short", "cut short", ""),
    ("qwen3", "", None, ""),
    ("glm45", "<think>Paris is the capital.</think>Paris.", "Paris is the capital.", "Paris."),
    ("glm45", "Paris.", None, "Paris."),  # thinking off: the template closed an empty <think></think> in the prompt
    ("seed_oss", "<seed:think>The capital.</seed:think>Paris.", "The capital.", "Paris."),
    ("minimax_m2", "The capital of France.\n</think>\n\nParis.", "The capital of France.\n", "Paris."),
    ("seed_oss", "Paris. <think>no</think>", None, "Paris. <think>no</think>"),
    ("ernie45", "Paris it is.\n</think>\n\n<response>\nParis.\n</response>\n", "Paris it is.\n", "Paris."),
    ("ernie45", "Short.\n</think>\nParis.", "Short.\n", "Paris."),
    ("ernie45", "a\n</think>\n<response>\nline one\n\nline two</response> and more", "a\n", "line one\n\nline two and more"),
    ("ernie45", "a</think><response>\nParis, cut sho", "a", "Paris, cut sho"),
    ("ernie45", "a</think><respo", "a", "<respo"),
    ("granite", "Here is my thought process:\n1 + 1 = 2.\nHere is my response:\nTwo.", "\n1 + 1 = 2.\n", "Two."),
    ("granite", "Here's my thought process: short. Here's my response: Done", " short. ", "Done"),
    ("granite", "Here is my answer, with no thought process.", None, "Here is my answer, with no thought process."),
    ("granite", "Here is my thought process: Here is my respo", " Here is my respo", ""),
    ("mistral", "[THINK]Check: 3 > 2.[/THINK]Three.", "Check: 3 > 2.", "Three."),
    ("mistral", "Three, without [THINK].", None, "Three, without [THINK]."),
    # gpt-oss's harmony messages: analysis is reasoning, final (and a commentary preamble) the answer, a call kept
    # in one form for the openai tool-call parser; the stop tokens <|return|> and <|call|> end the reply.
    ("openai_gptoss", "<|channel|>analysis<|message|>2 + 2 = 4.<|end|><|start|>assistant<|channel|>final<|message|>"
     "Four.", "2 + 2 = 4.", "Four."),
    ("openai_gptoss", "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>commentary<|message|>"
     "Checking.<|end|><|start|>assistant<|channel|>final<|message|>Done.<|return|>", "Think.", "Checking.Done."),
    ("openai_gptoss", "<|channel|>analysis<|message|>Need the tool.<|end|><|start|>assistant<|channel|>commentary "
     'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}', "Need the tool.",
     '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'),
    ("openai_gptoss", '<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}<|call|>', None,
     "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>"),
    ("openai_gptoss", "<|channel|>analysis<|message|>cut <|en", "cut <|en", ""),
    ("openai_gptoss", "<|channel|>final<|message|>No thoughts.", None, "No thoughts."),
    ("openai_gptoss", "Plain text, no <|channel|> header first.", None, "Plain text, no <|channel|> header first."),
    ("openai_gptoss", "<|chan", None, "<|chan"),  # no header after all: nothing is lost
    # Gemma 4's thought channel (its label dropped), ended by its closer or by a tool call (kept for the tool parser)
    ("gemma4", "<|channel>thought\n2 + 2 = 4.<channel|>Four.", "2 + 2 = 4.", "Four."),
    ("gemma4", "<|channel>Unlabelled.<channel|>\nFour.", "Unlabelled.", "Four."),
    ("gemma4", "<|channel>thought\nNeed it.<|tool_call>call:f{}<tool_call|>", "Need it.", "<|tool_call>call:f{}<tool_call|>"),
    ("gemma4", "<|channel>thought", "thought", ""),  # (cut short before its label's newline: the label is reasoning)
    ("gemma4", "Four, thinking off.", None, "Four, thinking off."),
]


@pytest.mark.parametrize("name, reply, reasoning, answer", CASES)
def test_parsers_split_reasoning_from_answer(name, reply, reasoning, answer):
    assert reasoning_parser(name).parse(reply) == (reasoning, answer)


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.floats(0, 1), max_size=10))
def test_a_stream_cut_anywhere_splits_as_the_whole_reply(case, cuts):
    name, reply, reasoning, answer = case
    s = reasoning_parser(name).stream()
    got_r, got_a, at = "", "", 0
    for cut in sorted(int(c * len(reply)) for c in cuts) + [len(reply)]:
        r, a = s.feed(reply[at:cut])
        got_r, got_a, at = got_r + r, got_a + a, cut
    r, a = s.finish()
    assert ((got_r + r) if s.reasoned else None, got_a + a) == (reasoning, answer)


def test_stream_gives_reasoning_as_it_comes():
    s = reasoning_parser("deepseek_r1").stream()
    assert s.feed("<thi") == ("", "")
    assert s.feed("nk>Let me see</th") == ("Let me see", ""), "a possible </think> is held"
    assert s.feed("ink>\n") == ("", "") and s.feed("\nThe answer") == ("", "The answer")
    with pytest.raises(ValueError, match="deepseek_r1"):
        reasoning_parser("o1")
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        ServerConfig(reasoning_parser="o1")
    assert sorted(REASONING_PARSERS) == ["apertus", "deepseek_r1", "deepseek_v3", "ernie45", "exaone4", "gemma4", "glm45",
                                         "granite",
                                         "kimi_k2", "minimax_m2", "mistral", "olmo3", "openai_gptoss", "qwen3",
                                         "seed_oss"]


def test_mistral_markers_are_kept_in_the_text():
    """Magistral's [THINK] and [/THINK] are special tokens: with the mistral parser the server asks the engine to
    keep special tokens in the reply's text, and not with the others."""
    for name, kept in (("mistral", True), ("qwen3", False)):
        eng = FakeAsyncEngine(step_delay=0.001, scripted_reply=lambda p: "[THINK]Sure.[/THINK]Yes.")
        try:
            with serve_in_thread(eng, ServerConfig(port=0, reasoning_parser=name)) as srv:
                c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
                m = _ask(c, "two").choices[0].message
                assert eng.submitted[-1][2].skip_special_tokens is not kept
                if kept:
                    assert (m.model_extra["reasoning"], m.content) == ("Sure.", "Yes.")
        finally:
            eng.shutdown()


REPLIES = {
    "one": "<think>\nThe user wants the weather; call the tool.\n</think>\n\n"
           '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
    "two": "<think>Easy.</think>\n\nIt is sunny.",
    "three": "I never closed my thoughts",
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def client():
    eng = FakeAsyncEngine(step_delay=0.001, scripted_reply=lambda p: next((REPLIES[w] for w in p.split() if w in REPLIES), None))
    config = ServerConfig(port=0, enable_auto_tool_choice=True, tool_call_parser="hermes",
                          reasoning_parser="deepseek_r1")
    with serve_in_thread(eng, config) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    eng.shutdown()


def _ask(client, word, **kw):
    return client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": word}], **kw)


def _accumulate(chunks):
    reasoning, content, calls, finish = "", "", [], None
    for ch in chunks:
        d = ch.choices[0].delta
        extra = d.model_extra or {}
        assert extra.get("reasoning") == extra.get("reasoning_content")
        reasoning += extra.get("reasoning") or ""
        content += d.content or ""
        for tc in d.tool_calls or []:  # a call's first piece names it, the others add to its arguments
            if tc.function.name:
                calls.append((tc.function.name, ""))
            calls[-1] = (calls[-1][0], calls[-1][1] + (tc.function.arguments or ""))
        finish = ch.choices[0].finish_reason or finish
    return reasoning, content, calls, finish


def test_reasoning_then_a_tool_call(client):
    m = _ask(client, "one", tools=TOOLS).choices[0]
    extra = m.message.model_extra
    assert extra["reasoning"] == extra["reasoning_content"] == "\nThe user wants the weather; call the tool.\n"
    assert m.message.content is None and m.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    r, c, calls, finish = _accumulate(_ask(client, "one", tools=TOOLS, stream=True))
    assert (r, c, finish) == (extra["reasoning"], "", "tool_calls")
    assert calls == [(x.function.name, x.function.arguments) for x in m.message.tool_calls]


def test_reasoning_then_an_answer(client):
    m = _ask(client, "two").choices[0].message
    assert (m.model_extra["reasoning"], m.content) == ("Easy.", "It is sunny.")
    assert _accumulate(_ask(client, "two", stream=True)) == ("Easy.", "It is sunny.", [], "stop")
    hidden = _ask(client, "two", extra_body={"include_reasoning": False}).choices[0].message
    assert hidden.content == "It is sunny." and "reasoning" not in (hidden.model_extra or {})
    cut = _ask(client, "three").choices[0].message
    assert cut.content is None and cut.model_extra["reasoning"] == REPLIES["three"]


def test_a_constrained_reply_thinks_first(client):
    """Under an output constraint the model thinks first (the engine holds the constraint from the answer:
    tests/test_constraint_after_reasoning.py): the reasoning is split off as without one."""
    m = _ask(client, "two", response_format={"type": "json_object"}).choices[0].message
    assert (m.model_extra["reasoning"], m.content) == ("Easy.", "It is sunny.")


def test_the_engine_is_told_where_the_answer_begins():
    """The server passes its parser's markers with a chat request's constraint, a forced tool call's too (not a
    completion's); a forced call's reasoning is split off, whole and streamed."""
    thought = '<think>The user wants Paris.</think>{"city": "Paris"}'
    eng = FakeAsyncEngine(step_delay=0.001, scripted_reply=lambda p: thought if "three" in p else '{"city": "Paris"}')
    named = {"type": "function", "function": {"name": "get_weather"}}
    try:
        with serve_in_thread(eng, ServerConfig(port=0, reasoning_parser="qwen3")) as srv:
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            _ask(c, "two", response_format={"type": "json_object"})
            assert eng.submitted[-1][2].structured_outputs.after_reasoning == (("<think>",), ("</think>",), False)
            for word in ("two", "three"):
                m = _ask(c, word, tools=TOOLS, tool_choice=named).choices[0]
                assert eng.submitted[-1][2].structured_outputs.after_reasoning is not None
                assert m.message.tool_calls[0].function.arguments == '{"city": "Paris"}'
                assert m.finish_reason == "tool_calls"
                assert (m.message.model_extra or {}).get("reasoning") == ("The user wants Paris." if word == "three"
                                                                          else None)
            r, content, calls, finish = _accumulate(_ask(c, "three", tools=TOOLS, tool_choice=named, stream=True))
            assert (r, content, calls, finish) == ("The user wants Paris.", "", [("get_weather", '{"city": "Paris"}')],
                                                   "tool_calls")
            m = _ask(c, "three", tools=TOOLS, tool_choice="required").choices[0]  # (the fake reply is no list)
            assert m.message.model_extra["reasoning"] == "The user wants Paris." and m.message.content == (
                '{"city": "Paris"}')
            c.completions.create(model="fake-model", prompt="two", extra_body={"response_format": {"type": "json_object"}})
            assert eng.submitted[-1][2].structured_outputs.after_reasoning is None
    finally:
        eng.shutdown()


def test_deepseek_v3_splits_reasoning_only_when_the_request_thinks():
    """DeepSeek-V3.1's hybrid thinking: with `chat_template_kwargs` `{"thinking": true}` the reply's thoughts end at
    `</think>` (its template opened them in the prompt) and are split off, streamed too, and a constraint holds
    after them; without, the reply is all answer and a constraint holds from its first token."""
    reply = "The user greets.</think>Hello!"
    eng = FakeAsyncEngine(step_delay=0.001, scripted_reply=lambda p: reply)
    try:
        with serve_in_thread(eng, ServerConfig(port=0, reasoning_parser="deepseek_v3")) as srv:
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            for kwargs in ({"thinking": True}, {"enable_thinking": True}):
                m = _ask(c, "hi", extra_body={"chat_template_kwargs": kwargs}).choices[0].message
                assert (m.model_extra["reasoning"], m.content) == ("The user greets.", "Hello!")
            streamed = _ask(c, "hi", stream=True, extra_body={"chat_template_kwargs": {"thinking": True}})
            assert _accumulate(streamed) == ("The user greets.", "Hello!", [], "stop")
            _ask(c, "hi", response_format={"type": "json_object"}, extra_body={"chat_template_kwargs": {"thinking": True}})
            assert eng.submitted[-1][2].structured_outputs.after_reasoning == (("<think>",), ("</think>",), True)
            for kwargs in ({}, {"thinking": False}):
                m = _ask(c, "hi", extra_body={"chat_template_kwargs": kwargs}).choices[0].message
                assert m.content == reply and "reasoning" not in (m.model_extra or {})
            _ask(c, "hi", response_format={"type": "json_object"})
            assert eng.submitted[-1][2].structured_outputs.after_reasoning is None
    finally:
        eng.shutdown()


HARMONY = ("<|channel|>analysis<|message|>The user wants the weather in Paris.<|end|><|start|>assistant<|channel|>"
           'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}')


def test_gpt_oss_harmony_reasoning_and_tool_calls_over_http():
    """gpt-oss served with `--reasoning-parser openai_gptoss --tool-call-parser openai`: the analysis channel is
    the reasoning, a message to `functions.NAME` a call, the final channel the content; special tokens are kept
    in the reply for the parsers; streamed as whole."""
    replies = {"seven": HARMONY, "eight": "<|channel|>analysis<|message|>Greet.<|end|><|start|>assistant"
                                             "<|channel|>final<|message|>Hi!"}
    eng = FakeAsyncEngine(step_delay=0.001, scripted_reply=lambda p: next(
        (replies[w] for w in p.split() if w in replies), None))
    config = ServerConfig(port=0, enable_auto_tool_choice=True, tool_call_parser="openai",
                          reasoning_parser="openai_gptoss")
    try:
        with serve_in_thread(eng, config) as srv:
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            m = _ask(c, "seven", tools=TOOLS).choices[0]
            assert eng.submitted[-1][2].skip_special_tokens is False
            assert m.message.model_extra["reasoning"] == "The user wants the weather in Paris."
            assert m.message.content is None and m.finish_reason == "tool_calls"
            assert [(t.function.name, json.loads(t.function.arguments)) for t in m.message.tool_calls] == [
                ("get_weather", {"city": "Paris"})]
            r, content, calls, finish = _accumulate(_ask(c, "seven", tools=TOOLS, stream=True))
            assert (r, content, finish) == ("The user wants the weather in Paris.", "", "tool_calls")
            assert calls == [(t.function.name, t.function.arguments) for t in m.message.tool_calls]
            hi = _ask(c, "eight").choices[0].message
            assert (hi.model_extra["reasoning"], hi.content) == ("Greet.", "Hi!")
            assert _accumulate(_ask(c, "eight", stream=True)) == ("Greet.", "Hi!", [], "stop")
    finally:
        eng.shutdown()


def test_parsers_that_apply_as_the_request_asks():
    """EXAONE 4.0 reasons only when asked with `enable_thinking` (its template opens `<think>` then); Kimi K2
    Thinking unless asked not to; DeepSeek-V3.1 with either name."""
    for name, kwargs, applies in (("exaone4", {"enable_thinking": True}, True), ("exaone4", {}, False),
                                  ("exaone4", {"thinking": True}, False), ("kimi_k2", {}, True),
                                  ("kimi_k2", {"thinking": False}, False), ("deepseek_v3", {"thinking": True}, True)):
        parser = reasoning_parser(name).for_request(kwargs)
        assert (parser is not None) is applies, (name, kwargs)
        if applies:
            assert parser.parse("Hm.</think>Yes.") == ("Hm.", "Yes.")


def test_kimi_k2_thinking_ends_at_a_tool_call_section():
    """Kimi K2 Thinking served with `--reasoning-parser kimi_k2 --tool-call-parser kimi_k2`: thoughts the prompt
    opened end at `</think>`, or where a tool call section begins unclosed (the section goes on to the tool-call
    parser); with `{"thinking": false}` the reply is all answer; streamed as whole."""
    call = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
            '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>')
    replies = {"one": "The user wants Paris's weather." + call, "two": "<think>Hi back.</think>Hello!"}
    eng = FakeAsyncEngine(step_delay=0.001, scripted_reply=lambda p: next(
        (r for w, r in replies.items() if w in p.split()), None))
    config = ServerConfig(port=0, enable_auto_tool_choice=True, tool_call_parser="kimi_k2", reasoning_parser="kimi_k2")
    try:
        with serve_in_thread(eng, config) as srv:
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            m = _ask(c, "one", tools=TOOLS).choices[0]
            assert m.message.model_extra["reasoning"] == "The user wants Paris's weather."
            assert [(t.function.name, json.loads(t.function.arguments)) for t in m.message.tool_calls] == [
                ("get_weather", {"city": "Paris"})] and m.finish_reason == "tool_calls"
            assert _accumulate(_ask(c, "one", tools=TOOLS, stream=True)) == (
                "The user wants Paris's weather.", "", [("get_weather", '{"city": "Paris"}')], "tool_calls")
            assert not eng.submitted[-1][2].skip_special_tokens  # (the markers are special tokens)
            m = _ask(c, "two").choices[0].message
            assert (m.model_extra["reasoning"], m.content) == ("Hi back.", "Hello!")
            m = _ask(c, "two", extra_body={"chat_template_kwargs": {"thinking": False}}).choices[0].message
            assert m.content == replies["two"] and "reasoning" not in (m.model_extra or {})
    finally:
        eng.shutdown()
