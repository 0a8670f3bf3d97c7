"""The server over the real engine on the bundled SmolLM2: HTTP greedy text equals `LLM.generate`'s."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from jaxserve.beam_search import BeamSearchParams
from jaxserve.sampling_params import SamplingParams
from server.config import ServerConfig
from server.runner import serve_in_thread
from tests.conftest import REAL_ENGINE_ARGS

pytestmark = pytest.mark.slow

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]
PROMPT = "The three primary colors are"
MAX_TOKENS = 24
BEAM_TOKENS = 6


@pytest.fixture(scope="module")
def real():
    """(reference texts from LLM.generate, a server over an AsyncEngine on the same engine, the engine,
    LLM.beam_search's beams of CHATS[0] and PROMPT)."""
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.llm import LLM

    llm = LLM(None, **REAL_ENGINE_ARGS, progress=False)
    tok = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    prompts = [tok.encode_chat(c) for c in CHATS] + [PROMPT]
    reference = [out.outputs[0].text for out in llm.generate(prompts, greedy, use_tqdm=False)]
    beams = llm.beam_search([prompts[0], prompts[2]], BeamSearchParams(beam_width=3, max_tokens=BEAM_TOKENS))
    llm.engine.reset_prefix_cache()
    engine = AsyncEngine(llm.engine)
    with serve_in_thread(engine, ServerConfig(port=0, enable_auto_tool_choice=True, tool_call_parser="hermes")) as srv:
        yield reference, srv, engine, beams
    engine.shutdown()


def test_greedy_text_over_http_equals_llm_generate(real):
    reference, srv, _, _ = real
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    for chat, expected in zip(CHATS, reference[:2], strict=True):
        r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=chat, temperature=0,
                                           max_tokens=MAX_TOKENS)
        assert r.choices[0].message.content == expected
        streamed = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=chat, temperature=0,
                                                  max_tokens=MAX_TOKENS, stream=True,
                                                  stream_options={"include_usage": True})
        chunks = list(streamed)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
        # The same prompt again: its whole pages come from the prefix cache.
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, temperature=0,
                                  max_tokens=MAX_TOKENS)
    assert r.choices[0].text == reference[2]


def test_beam_search_over_http_equals_llm_beam_search(real):
    """vLLM's `use_beam_search` with `n` beams, on chat and completions, whole and streamed: the beams'
    texts, in order, are LLM.beam_search's on the same engine; with logprobs each beam's tokens' logprobs
    add up to its cumulative logprob. No request is left in the engine."""
    _, srv, engine, beams = real
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    kw = dict(model="SmolLM2-135M-Instruct", n=3, max_tokens=BEAM_TOKENS, extra_body={"use_beam_search": True})
    chat, completion = ([b.text for b in out.sequences] for out in beams)
    r = client.chat.completions.create(messages=CHATS[0], logprobs=True, **kw)
    assert [c.message.content for c in r.choices] == chat
    for c, b in zip(r.choices, beams[0].sequences, strict=True):
        assert sum(t.logprob for t in c.logprobs.content) == pytest.approx(b.cum_logprob, abs=1e-4)
        assert c.finish_reason == b.finish_reason
    streamed = client.chat.completions.create(messages=CHATS[0], stream=True, **kw)
    texts = ["", "", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == chat
    r = client.completions.create(prompt=PROMPT, **kw)
    assert [c.text for c in r.choices] == completion
    assert r.usage.completion_tokens == sum(len(b.tokens) for b in beams[1].sequences) - 3 * r.usage.prompt_tokens
    assert engine.stats().num_running == 0 and engine.stats().num_waiting == 0


def test_responses_api_gives_the_chat_reply(real):
    """`/v1/responses` on the real model: the greedy reply `LLM.generate` gives, whole and streamed, with the
    prompt's whole pages counted as written to the prefix cache, then read from it."""
    reference, srv, engine, _ = real
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    chat = CHATS[1]
    engine.engine.reset_prefix_cache()
    r = client.responses.create(model="SmolLM2-135M-Instruct", input=chat[0]["content"], temperature=0,
                                max_output_tokens=MAX_TOKENS)
    assert r.output_text == reference[1] and r.status == "incomplete"  # 24 tokens cut the haiku
    details, ps = r.usage.input_tokens_details, engine.prefix_cache_page_size
    assert (details.cached_tokens, details.cache_write_tokens) == (0, r.usage.input_tokens // ps * ps)
    events = list(client.responses.create(model="SmolLM2-135M-Instruct", input=chat, temperature=0,
                                          max_output_tokens=MAX_TOKENS, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == reference[1]
    final = events[-1].response
    assert events[-1].type == "response.incomplete" and final.output_text == reference[1]
    assert final.usage.input_tokens_details.cached_tokens == details.cache_write_tokens


def _metric(srv, name: str) -> float:
    for line in httpx.get(srv.url + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(name)


def test_disconnect_frees_the_pages(real):
    _, srv, engine, _ = real
    body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "temperature": 0,
            "stream": True}
    # Pages only the prefix cache keeps count as free, as in vLLM: after the abort usage is back where it was.
    usage_before = _metric(srv, "vllm:kv_cache_usage_perc")
    generated_before = _metric(srv, "vllm:generation_tokens_total")
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()  # held, so the stream stays open until the block ends (a dropped iterator closes it)
        for line in lines:
            if line.startswith("data: "):
                assert json.loads(line[6:])["choices"]
                break
        # The engine thread publishes its stats snapshot once per loop, so it may trail the first chunk.
        deadline = time.monotonic() + 10
        while not (_metric(srv, "vllm:num_requests_running") == 1
                   and _metric(srv, "vllm:kv_cache_usage_perc") > usage_before):
            assert time.monotonic() < deadline, "the running request and its pages never showed in the metrics"
            time.sleep(0.05)
    deadline = time.monotonic() + 20
    while srv.state.active:
        assert time.monotonic() < deadline, "the server did not abort the request of the client that left"
        time.sleep(0.05)
    # AsyncEngine refreshes its stats snapshot after a step, not after an abort: one small request steps it.
    httpx.post(srv.url + "/v1/completions", json={**body, "max_tokens": 1, "stream": False}, timeout=60)
    assert _metric(srv, "vllm:num_requests_running") == 0
    assert not srv.state.active
    generated = _metric(srv, "vllm:generation_tokens_total") - generated_before
    assert 0 < generated < 200, "aborted before the end"
    num_pages = engine.stats().num_pages - 1  # page 0 is never handed out
    held = round((_metric(srv, "vllm:kv_cache_usage_perc") - usage_before) * num_pages)
    assert held == 0, f"{held} pages still held by requests after the abort"
    engine.check_integrity()
    assert _metric(srv, "jaxserve:compilations_after_warmup_total") == 0


def test_response_format_json_schema_over_http(real):
    """OpenAI's `response_format` (json_schema, streamed too) and vLLM's `structured_outputs` extra."""
    _, srv, _, _ = real
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
              "required": ["city"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "capital", "schema": schema, "strict": True}}
    chat = [{"role": "user", "content": "Which city is the capital of France? Reply in JSON."}]
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=chat, temperature=0,
                                       max_tokens=40, response_format=fmt)
    value = json.loads(r.choices[0].message.content)
    assert list(value) == ["city"] and isinstance(value["city"], str) and r.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=chat, temperature=0,
                                              max_tokens=40, response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == r.choices[0].message.content
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The sky is", temperature=0, max_tokens=8,
                                  extra_body={"structured_outputs": {"choice": [" green", " purple"]}})
    assert r.choices[0].text in (" green", " purple")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=chat,
                                       extra_body={"structured_outputs": {"regex": "(a"}})
    assert info.value.body["param"] == "structured_outputs" and "unclosed group" in info.value.body["message"]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                                       "required": ["zone"], "additionalProperties": False}}}


def test_forced_tool_calls_over_http(real):
    """tool_choice naming a function, and "required": the reply is tool calls whose arguments fit the
    tools' schemas, whole and streamed (each call's arguments in pieces as they are written)."""
    _, srv, _, _ = real
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    chat = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for tool_choice in (named, "required"):
        kw = dict(model="SmolLM2-135M-Instruct", messages=chat, temperature=0, max_tokens=120,
                  tools=[WEATHER, TIME], tool_choice=tool_choice)
        r = client.chat.completions.create(**kw)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        calls = choice.message.tool_calls
        assert calls and all(c.id.startswith("call_") and c.type == "function" for c in calls)
        for c in calls:
            args = json.loads(c.function.arguments)
            assert c.function.name in ("get_weather", "get_time")
            assert list(args) == (["city"] if c.function.name == "get_weather" else ["zone"])
        if tool_choice is named:
            assert [c.function.name for c in calls] == ["get_weather"]
        chunks = list(client.chat.completions.create(**kw, stream=True))
        deltas = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        assert not any(ch.choices[0].delta.content for ch in chunks if ch.choices)
        names = [d.function.name for d in deltas if d.function.name]
        assert names == [c.function.name for c in calls]
        args = {}
        for d in deltas:
            args[d.index] = args.get(d.index, "") + (d.function.arguments or "")
        assert [json.loads(a) for a in args.values()] == [json.loads(c.function.arguments) for c in calls]
        assert len(deltas) > len(calls), "the calls' arguments stream in pieces"


def test_auto_tool_choice_leaves_a_text_reply_as_it_is(real):
    """tool_choice "auto" with the hermes parser: SmolLM2 answers in text, which comes back exactly
    as with tool_choice "none", whole and streamed."""
    _, srv, _, _ = real
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    kw = dict(model="SmolLM2-135M-Instruct", messages=CHATS[1], temperature=0, max_tokens=MAX_TOKENS,
              tools=[WEATHER, TIME])
    plain = client.chat.completions.create(**kw, tool_choice="none").choices[0]
    auto = client.chat.completions.create(**kw).choices[0]
    assert plain.message.content and auto.message.content == plain.message.content
    assert auto.message.tool_calls is None and auto.finish_reason == plain.finish_reason
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.message.content


def test_echo_with_logprobs_scores_the_prompt(real):
    """Completions with echo and logprobs (how evaluation harnesses score text): the prompt's tokens
    lead `logprobs`, the first without a logprob, the rest as the engine's prompt logprobs; the same
    streamed. vLLM's `prompt_logprobs` field on chat."""
    _, srv, engine, _ = real
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    tok = engine.tokenizer
    ids = tok.encode(PROMPT, add_special_tokens=True)
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, temperature=0, max_tokens=3,
                                  echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(PROMPT) and len(lp.tokens) == len(ids) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs[1:])
    assert all(len(t) >= 1 for t in lp.top_logprobs[1:]) and lp.text_offset == sorted(lp.text_offset)
    streamed = list(client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, temperature=0,
                                              max_tokens=3, echo=True, logprobs=2, stream=True))
    got = [x for ch in streamed if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.token_logprobs]
    assert got[0] is None and got[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    body = httpx.post(srv.url + "/v1/chat/completions", json={
        "messages": CHATS[0], "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1}, timeout=60).json()
    plp = body["prompt_logprobs"]
    chat_ids = tok.encode_chat(CHATS[0])
    assert plp[0] is None and len(plp) == len(chat_ids)
    assert all(str(t) in plp[p] for p, t in enumerate(chat_ids) if p > 0)
