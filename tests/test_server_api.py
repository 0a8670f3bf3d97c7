"""The OpenAI API over a real Hypercorn server on 127.0.0.1, on the fake engine (outputs known by hand)."""

from __future__ import annotations

import asyncio
import json
import socket
from types import SimpleNamespace

import httpx
import openai
import pytest

from server.config import ServerConfig
from server.fake_engine import WORDS, FakeAsyncEngine
from server.runner import serve_in_thread
from tests.test_server_errors import _wait

MSG = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def engine():
    eng = FakeAsyncEngine(step_delay=0.001)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    with serve_in_thread(engine, ServerConfig(port=0, served_model_names=("fake-model", "alias"))) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def sse_events(server, path, body, headers=None):
    """The parsed `data:` payloads of a streaming request (`[DONE]` kept as the string)."""
    events = []
    with httpx.stream("POST", server.url + path, json=body, headers=headers, timeout=30) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = "".join(r.iter_text())
    assert raw.endswith("data: [DONE]\n\n")
    for block in raw.split("\n\n"):
        if block:
            assert block.startswith("data: ")
            payload = block[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_chat_greedy_text_is_the_fake_words(client):
    r = client.chat.completions.create(model="fake-model", messages=MSG, temperature=0, max_tokens=5)
    assert r.choices[0].message.content == "one two three four five"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5 and r.usage.total_tokens == r.usage.prompt_tokens + 5
    assert r.object == "chat.completion" and r.model == "fake-model"


def test_chat_without_max_tokens_runs_to_eos(client):
    r = client.chat.completions.create(model="alias", messages=MSG, temperature=0)
    assert r.choices[0].message.content == " ".join(WORDS)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == len(WORDS) + 1


def test_completion_with_stop_and_n(client):
    r = client.completions.create(model="fake-model", prompt="hello world", temperature=0, max_tokens=6, n=2,
                                  stop=["four"])
    texts = sorted((c.index, c.text, c.finish_reason) for c in r.choices)
    assert texts == [(0, "one two three ", "stop"), (1, "two three ", "stop")]
    r = client.completions.create(model="fake-model", prompt="hello", temperature=0, max_tokens=6,
                                  stop=["four"], extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text == "one two three four"


def test_chat_stream_chunk_sequence_is_well_formed(server):
    body = {"model": "fake-model", "messages": MSG, "temperature": 0, "max_tokens": 4, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    events = sse_events(server, "/v1/chat/completions", body, headers={"X-Request-Id": "my id/1"})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"] == "chatcmpl-my id/1"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8
    assert usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert all(c["usage"] is None for c in chunks[:-1])
    for index, expected in ((0, "one two three four"), (1, "two three four five")):
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(ch["delta"].get("content", "") for ch in mine) == expected
        assert [ch["finish_reason"] for ch in mine][-1] == "length"
        assert all(ch["finish_reason"] is None for ch in mine[:-1])
        assert all("role" not in ch["delta"] for ch in mine[1:])


def test_completion_stream_and_usage(server):
    body = {"prompt": "hello", "temperature": 0, "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    events = sse_events(server, "/v1/completions", body)
    chunks = events[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "one two three"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"] == {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4,
                                   "prompt_tokens_details": {"cached_tokens": 0}}


def test_openai_client_stream(client):
    stream = client.chat.completions.create(model="fake-model", messages=MSG, temperature=0, max_tokens=3,
                                            stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == "one two three"


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="fake-model", messages=MSG, temperature=0, max_tokens=2,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [t.token for t in content] == ["one", "two"]
    assert [t.logprob for t in content] == [-0.25, -0.25]
    assert [[(x.token, x.logprob) for x in t.top_logprobs] for t in content] == [
        [("one", -0.25), ("two", -1.25)], [("two", -0.25), ("three", -1.25)]]
    assert content[0].bytes == list(b"one")


def test_completion_logprobs_and_echo(client):
    r = client.completions.create(model="fake-model", prompt="hello", temperature=0, max_tokens=3, logprobs=1)
    lp = r.choices[0].logprobs
    assert lp.tokens == ["one", "two", "three"] and lp.token_logprobs == [-0.25] * 3
    assert lp.top_logprobs == [{"one": -0.25}, {"two": -0.25}, {"three": -0.25}]
    assert lp.text_offset == [0, 3, 6]
    r = client.completions.create(model="fake-model", prompt="hello", temperature=0, max_tokens=2, echo=True)
    assert r.choices[0].text == "helloone two"


def test_batched_completion_prompts(client):
    r = client.completions.create(model="fake-model", prompt=["hello", [3, 4]], temperature=0, max_tokens=2)
    assert sorted((c.index, c.text) for c in r.choices) == [(0, "one two"), (1, "one two")]
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 4


def test_seed_reproducible(client):
    def text(seed):
        return client.completions.create(model="fake-model", prompt="hello", temperature=1.0, seed=seed,
                                         max_tokens=4).choices[0].text

    a = text(1234)
    assert a == text(1234)
    assert len({text(s) for s in range(6)}) > 1, "different seeds should not all agree"


def test_cached_tokens_reported_on_repeat(client, engine):
    prompt = " ".join(["hello"] * 40)
    first = client.completions.create(model="fake-model", prompt=prompt, temperature=0, max_tokens=1)
    second = client.completions.create(model="fake-model", prompt=prompt, temperature=0, max_tokens=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 32  # whole 16-token pages, last token excluded


def test_sampling_extras_reach_the_engine(client, engine):
    client.chat.completions.create(
        model="fake-model", messages=MSG, temperature=0.3, max_tokens=3, seed=5,
        extra_body={"top_k": 4, "min_p": 0.2, "repetition_penalty": 1.2, "stop_token_ids": [9], "min_tokens": 1,
                    "ignore_eos": True, "skip_special_tokens": False, "priority": 3, "cache_salt": "tenant-a"},
        extra_headers={"X-Request-Id": "extras-1"})
    rid, _, params, priority, salt = next(s for s in engine.submitted if s[0] == "extras-1")
    assert (params.top_k, params.min_p, params.repetition_penalty, params.stop_token_ids) == (4, 0.2, 1.2, [9])
    assert (params.min_tokens, params.ignore_eos, params.skip_special_tokens, params.seed) == (1, True, False, 5)
    assert (priority, salt, params.temperature, params.max_tokens) == (3, "tenant-a", 0.3, 3)


def test_return_token_ids_whole_and_streamed(server):
    """vLLM's `return_token_ids`: the prompt's ids (chat: on the response, completions: on each choice; streamed:
    on the first chunk) and each completion's ids (streamed: each chunk's new ones)."""
    chat = {"model": "fake-model", "messages": MSG, "temperature": 0, "max_tokens": 3, "return_token_ids": True}
    whole = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=10).json()
    prompt_ids = whole["prompt_token_ids"]
    assert prompt_ids == [1, 19, 22, 2, 1, 20]  # <|im_start|>user hello<|im_end|> <|im_start|>assistant
    assert whole["choices"][0]["token_ids"] == [3, 4, 5]  # "one two three"
    chunks = [c for c in sse_events(server, "/v1/chat/completions", {**chat, "stream": True})[:-1]]
    assert chunks[0]["prompt_token_ids"] == prompt_ids and all("prompt_token_ids" not in c for c in chunks[1:])
    assert sum((c["choices"][0].get("token_ids") or [] for c in chunks), []) == [3, 4, 5]
    body = {"model": "fake-model", "prompt": ["hello", "hello world"], "temperature": 0, "max_tokens": 2,
            "return_token_ids": True}
    whole = httpx.post(server.url + "/v1/completions", json=body, timeout=10).json()
    assert [(c["prompt_token_ids"], c["token_ids"]) for c in sorted(whole["choices"], key=lambda c: c["index"])] == [
        ([22], [3, 4]), ([22, 23], [3, 4])]
    chunks = [c for c in sse_events(server, "/v1/completions", {**body, "stream": True})[:-1]]
    for index, prompt in ((0, [22]), (1, [22, 23])):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["prompt_token_ids"] == prompt and all("prompt_token_ids" not in c for c in mine[1:])
        assert sum((c["token_ids"] for c in mine), []) == [3, 4]
    plain = httpx.post(server.url + "/v1/completions", json={**body, "return_token_ids": False}, timeout=10).json()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]


def test_tokenize_renders_messages_as_chat_does(server):
    """`/tokenize` of messages gives the ids a chat request with the same fields reads (its `prompt_token_ids`),
    `continue_final_message` included, and refuses a request template the same way."""
    msgs = MSG + [{"role": "assistant", "content": "one two"}]
    fields = {"messages": msgs, "continue_final_message": True, "add_generation_prompt": False}
    chat = httpx.post(server.url + "/v1/chat/completions", json={**fields, "max_tokens": 1, "return_token_ids": True},
                      timeout=10).json()
    tokens = httpx.post(server.url + "/tokenize", json=fields, timeout=10).json()
    assert tokens["tokens"] == chat["prompt_token_ids"] == [1, 19, 22, 2, 1, 20, 3, 4]
    r = httpx.post(server.url + "/tokenize", json={**fields, "chat_template": "{{ messages }}"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"


def test_return_tokens_as_token_ids(client):
    r = client.chat.completions.create(model="fake-model", messages=MSG, temperature=0, max_tokens=2, logprobs=True,
                                       top_logprobs=2, extra_body={"return_tokens_as_token_ids": True})
    content = r.choices[0].logprobs.content
    assert [t.token for t in content] == ["token_id:3", "token_id:4"]
    assert [[x.token for x in t.top_logprobs] for t in content] == [["token_id:3", "token_id:4"],
                                                                     ["token_id:4", "token_id:5"]]
    r = client.completions.create(model="fake-model", prompt="hello", temperature=0, max_tokens=2, logprobs=1,
                                  extra_body={"return_tokens_as_token_ids": True})
    assert r.choices[0].logprobs.tokens == ["token_id:3", "token_id:4"] and r.choices[0].text == "one two"


def test_vocabulary_limits_and_truncation_reach_the_engine(client, engine, server):
    client.completions.create(model="fake-model", prompt="hello world one two", temperature=0, max_tokens=2,
                              extra_body={"allowed_token_ids": [3, 4], "bad_words": ["five", "six seven"],
                                          "truncate_prompt_tokens": 2}, extra_headers={"X-Request-Id": "limits-1"})
    _, ids, params, _, _ = next(s for s in engine.submitted if s[0] == "limits-1")
    assert ids == [3, 4]  # "one two": the prompt's last two tokens
    assert (params.allowed_token_ids, params.bad_words, params.truncate_prompt_tokens) == ((3, 4), ["five", "six seven"],
                                                                                           2)
    r = client.completions.create(model="fake-model", prompt="hello world one two", temperature=0, max_tokens=1,
                                  echo=True, extra_body={"truncate_prompt_tokens": 2})
    assert r.choices[0].text == "one twoone" and r.usage.prompt_tokens == 2  # what is echoed is what the model read
    for extra, param in (({"allowed_token_ids": [3, 99]}, "allowed_token_ids"),
                         ({"allowed_token_ids": []}, "allowed_token_ids"),
                         ({"bad_words": "five"}, "bad_words"),
                         ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                         ({"truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens")):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 1, **extra}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)


def test_request_chat_templates_need_trust_and_hooks_are_refused(server):
    for extra, param in (({"chat_template": "{{ messages[0]['content'] }}"}, "chat_template"),
                         ({"chat_template_kwargs": {"chat_template": "x"}}, "chat_template_kwargs"),
                         ({"logits_processors": ["my.Processor"]}, "logits_processors"),
                         ({"vllm_xargs": {"k": 1}}, "vllm_xargs"),
                         ({"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
                         ({"mm_processor_kwargs": {"do_pan_and_scan": True}}, "mm_processor_kwargs"),
                         ({"documents": "text"}, "documents")):
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 1, **extra},
                       timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)


def test_a_trusted_request_template_with_documents_and_reasoning_effort(engine):
    """With --trust-request-chat-template a request's `chat_template` renders its prompt, `documents` and
    `reasoning_effort` reaching it; one that does not compile is a 400 naming it."""
    template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}{% for d in documents %}{{ d['text'] }} "
                "{% endfor %}{{ reasoning_effort }}")
    with serve_in_thread(engine, ServerConfig(port=0, trust_request_chat_template=True)) as srv:
        body = {"messages": MSG, "max_tokens": 1, "chat_template": template, "reasoning_effort": "two",
                "documents": [{"title": "w", "text": "world"}]}
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "tpl-1"}, timeout=10)
        assert r.status_code == 200, r.text
        _, ids, _, _, _ = next(s for s in engine.submitted if s[0] == "tpl-1")
        assert ids == [22, 23, 4]  # "hello world two"
        r = httpx.post(srv.url + "/v1/chat/completions", json={**body, "chat_template": "{% if %}"}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"


def test_server_defaults_for_chat_template_kwargs_and_token_ids(engine):
    """`--default-chat-template-kwargs` reaches every chat's template (chat, /tokenize), a request's own keys win;
    `--return-tokens-as-token-ids` makes "token_id:N" the default, which a request may turn off."""
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}{{ flag }} {{ other }}"
    config = ServerConfig(port=0, chat_template=template, default_chat_template_kwargs={"flag": "one", "other": "two"},
                          return_tokens_as_token_ids=True)
    with serve_in_thread(engine, config) as srv:
        body = {"messages": MSG, "max_tokens": 2, "temperature": 0, "logprobs": True}
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "dflt-1"}, timeout=10)
        assert r.status_code == 200, r.text
        assert [t["token"] for t in r.json()["choices"][0]["logprobs"]["content"]] == ["token_id:3", "token_id:4"]
        _, ids, _, _, _ = next(s for s in engine.submitted if s[0] == "dflt-1")
        assert ids == [22, 3, 4]  # "hello one two"
        mine = {**body, "chat_template_kwargs": {"other": "world"}, "return_tokens_as_token_ids": False}
        r = httpx.post(srv.url + "/v1/chat/completions", json=mine, headers={"X-Request-Id": "dflt-2"}, timeout=10)
        assert [t["token"] for t in r.json()["choices"][0]["logprobs"]["content"]] == ["one", "two"]
        _, ids, _, _, _ = next(s for s in engine.submitted if s[0] == "dflt-2")
        assert ids == [22, 3, 23]  # "hello one world"
        r = httpx.post(srv.url + "/tokenize", json={"messages": MSG}, timeout=10)
        assert r.json()["tokens"] == [22, 3, 4]
    with pytest.raises(ValueError, match="default_chat_template_kwargs must be a JSON object"):
        ServerConfig(default_chat_template_kwargs=["flag"])
    with pytest.raises(ValueError, match="may not hold a chat_template: give it as --chat-template"):
        ServerConfig(default_chat_template_kwargs={"chat_template": "{{ messages }}"})


def test_chat_echo_leads_with_the_final_assistant_message(client, server):
    """vLLM's chat `echo`: the final assistant message being continued leads the reply, whole and streamed."""
    msgs = MSG + [{"role": "assistant", "content": "one two"}]
    extra = {"echo": True, "continue_final_message": True, "add_generation_prompt": False}
    r = client.chat.completions.create(model="fake-model", messages=msgs, temperature=0, max_tokens=2,
                                       extra_body=extra)
    assert r.choices[0].message.content == "one twoone two"
    body = {"messages": msgs, "temperature": 0, "max_tokens": 2, "stream": True, **extra}
    chunks = sse_events(server, "/v1/chat/completions", body)[:-1]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "one twoone two"
    plain = client.chat.completions.create(model="fake-model", messages=MSG, temperature=0, max_tokens=2,
                                           extra_body={"echo": True})  # the last message is the user's
    assert plain.choices[0].message.content == "one two"


def test_content_parts_are_joined(client, engine):
    r = client.chat.completions.create(
        model="fake-model", temperature=0, max_tokens=1,
        messages=[{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]}])
    assert r.choices[0].message.content == "one"
    prompt_ids = engine.submitted[-1][1]
    assert engine.tokenizer.decode(prompt_ids, skip_special_tokens=False).count("hello world") == 1


def test_request_id_echoed(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 1},
                   headers={"X-Request-Id": "client-chosen-id-"})
    assert r.headers["x-request-id"] == "client-chosen-id-"
    assert r.json()["id"] == "cmpl-client-chosen-id-"
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 1})
    assert len(r.headers["x-request-id"]) == 32


def test_models_tokenize_detokenize(server):
    data = httpx.get(server.url + "/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["fake-model", "alias"] and data[0]["max_model_len"] == 256
    assert httpx.get(server.url + "/v1/models/alias").json()["id"] == "alias"
    tok = httpx.post(server.url + "/tokenize", json={"prompt": "one two"}).json()
    assert tok["tokens"] == [3, 4] and tok["count"] == 2 and tok["max_model_len"] == 256
    chat = httpx.post(server.url + "/tokenize", json={"messages": MSG}).json()
    assert chat["tokens"][0] == 1 and chat["count"] == len(chat["tokens"])
    assert httpx.post(server.url + "/detokenize", json={"tokens": [3, 4]}).json() == {"prompt": "one two"}


def test_health_ready_and_h2c(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/ready").json() == {"status": "ready"}
    with httpx.Client(http1=False, http2=True) as h2:
        r = h2.post(server.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2, "temperature": 0})
        assert r.http_version == "HTTP/2" and r.json()["choices"][0]["text"] == "one two"


def test_32_concurrent_streams(server):
    async def one(client, i):
        body = {"prompt": "hello", "max_tokens": 8 + i % 5, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        text, usage = "", None
        async with client.stream("POST", server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    text += "".join(c["text"] for c in chunk["choices"])
                    usage = chunk.get("usage") or usage
        return i, text, usage

    async def main():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    for i, text, usage in asyncio.run(main()):
        n = 8 + i % 5
        assert text == " ".join(WORDS[:n]) and usage["completion_tokens"] == n


def test_metrics_names(server, client):
    client.completions.create(model="fake-model", prompt="hello", max_tokens=2, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:cache_config_info", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:request_success_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_count",
                 "vllm:request_queue_time_seconds_sum", "jaxserve:compilations_after_warmup_total",
                 "jaxserve:step_time_seconds", "vllm:spec_decode_num_drafts_total",
                 "vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"):
        assert f'\n{name}{{' in text, name
    assert 'vllm:request_success_total{finished_reason="length",model_name="fake-model"}' in text
    assert 'cache_dtype="auto"' in text and 'calculate_kv_scales="False"' in text  # vLLM's labels and values
    assert 'block_size="16"' in text and 'num_gpu_blocks="256"' in text


def test_accepted_drafts_by_position_as_vllm_names_them():
    import dataclasses

    from prometheus_client import CollectorRegistry, generate_latest

    from server.fake_engine import zero_engine_stats
    from server.metrics import _EngineCollector

    stats = dataclasses.replace(zero_engine_stats(), spec_num_accepted_tokens=7, spec_num_accepted_tokens_per_pos=(4, 2, 1))
    registry = CollectorRegistry()
    registry.register(_EngineCollector(type("E", (), {"stats": lambda self: stats})(), "m"))
    text = generate_latest(registry).decode()
    for position, count in enumerate((4, 2, 1)):
        assert f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{position}"}} {count}.0' \
            in text


def test_fake_and_loading_engines_report_the_real_stats_type():
    """The fake engine and the loading placeholder answer with the engine's own `EngineStats`, so
    the metrics code never sees fields the real engine lacks (or misses ones it has)."""
    from jaxserve.engine.request_state import EngineStats
    from server.state import LoadingEngine

    fake = FakeAsyncEngine()
    try:
        stats = fake.stats()
    finally:
        fake.shutdown()
    assert type(stats) is EngineStats and stats.num_pages > 0
    loading = LoadingEngine("m").stats()
    assert type(loading) is EngineStats and loading.num_running == 0


# Beam search over HTTP (vLLM's `use_beam_search`): the fake engine's next-token logprobs are known by hand,
# every position's most likely words being "one" (-0.25), "two" (-1.25), "three" (-2.25), ...
BEAM = {"use_beam_search": True}


def test_completion_beams_are_the_best_two_word_sequences(client, engine):
    """Width 3, two tokens: after "one" (-0.25), "two" (-1.25), "three" (-2.25) the best three of the nine
    two-word candidates are "one one" (-0.5), then "one two" and "two one" (-1.5 each, the earlier beam's
    first), each the sum of its tokens' logprobs; the steps were one request, then three, of one token each
    with the top 6 logprobs."""
    engine.submitted.clear()
    r = client.completions.create(model="fake-model", prompt="hello", n=3, max_tokens=2, logprobs=2,
                                  extra_body=BEAM)
    assert [c.text for c in r.choices] == ["one one", "one two", "two one"]
    assert [c.index for c in r.choices] == [0, 1, 2] and {c.finish_reason for c in r.choices} == {"length"}
    sums = [sum(c.logprobs.token_logprobs) for c in r.choices]
    assert sums == pytest.approx([-0.5, -1.5, -1.5])
    assert r.choices[0].logprobs.tokens == ["one", "one"] and len(r.choices[0].logprobs.top_logprobs[0]) == 2
    assert r.usage.completion_tokens == 6
    steps = [(rid.rsplit("-", 1)[-1], p.max_tokens, p.logprobs) for rid, _, p, _, _ in engine.submitted]
    assert steps == [("beam0.0", 1, 6), ("beam1.0", 1, 6), ("beam1.1", 1, 6), ("beam1.2", 1, 6)]
    prompt = engine.submitted[0][1]
    assert [ids[:len(prompt)] == prompt and len(ids) == len(prompt) + 1 for _, ids, *_ in engine.submitted[1:]] \
        == [True] * 3


def test_length_penalty_reranks_the_finished_beams(client):
    """Beams that end at different lengths only with EOS, which the fake model never ranks high; with equal
    lengths the penalty divides every score by the same number, so the order stays and the texts agree."""
    plain = client.completions.create(model="fake-model", prompt="hello", n=2, max_tokens=3, extra_body=BEAM)
    penalized = client.completions.create(model="fake-model", prompt="hello", n=2, max_tokens=3,
                                          extra_body=BEAM | {"length_penalty": 2.0})
    assert [c.text for c in plain.choices] == [c.text for c in penalized.choices] == ["one one one", "one one two"]


def test_chat_beams_whole_and_streamed(client, server):
    """A chat beam search answers `n` messages, best first; streamed, each choice comes whole in one chunk
    (after its role chunk) with its finish reason."""
    r = client.chat.completions.create(model="fake-model", messages=MSG, n=2, max_tokens=2, extra_body=BEAM)
    assert [c.message.content for c in r.choices] == ["one one", "one two"]
    body = {"model": "fake-model", "messages": MSG, "n": 2, "max_tokens": 2, "stream": True, **BEAM}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    content = [(e["choices"][0]["index"], e["choices"][0]["delta"].get("content"), e["choices"][0]["finish_reason"])
               for e in events]
    assert content == [(0, "", None), (0, "one one", "length"), (1, "", None), (1, "one two", "length")]


@pytest.mark.parametrize("extra,param", [
    ({"n": 11}, "n"),
    ({"top_p": 0.5}, "top_p"),
    ({"top_k": 5}, "top_k"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"min_tokens": 1}, "min_tokens"),
    ({"stop": ["x"]}, "stop"),
    ({"stop_token_ids": [5]}, "stop_token_ids"),
    ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"allowed_token_ids": [3]}, "allowed_token_ids"),
    ({"bad_words": ["one"]}, "bad_words"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ({"use_beam_search": False, "length_penalty": 0.5}, "length_penalty"),
])
def test_what_a_beam_search_cannot_honour_is_refused(server, extra, param):
    body = {"model": "fake-model", "messages": MSG, "n": 2, "max_tokens": 2, **BEAM, **extra}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_client_leaving_aborts_the_beams_step(server, engine):
    engine.pause()
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            body = json.dumps({"prompt": "hello", "max_tokens": 5, "n": 2, **BEAM}).encode()
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"X-Request-Id: beam-leaver\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
                      + body)
            assert _wait(lambda: engine.stats().num_waiting == 1)
        assert _wait(lambda: "beam-leaver-beam0.0" in engine.aborted), engine.aborted
        assert _wait(lambda: engine.stats().num_waiting == 0)
        assert _wait(lambda: not server.state.active)
    finally:
        engine.resume()


def test_data_parallel_stats_sum_accepted_drafts_by_position():
    import dataclasses
    from types import SimpleNamespace

    from server.fake_engine import zero_engine_stats
    from sharding.data_parallel import DataParallelEngine

    a = dataclasses.replace(zero_engine_stats(), spec_num_accepted_tokens_per_pos=(4, 2), running_lora_adapters=("x",))
    b = dataclasses.replace(zero_engine_stats(), spec_num_accepted_tokens_per_pos=(1, 1, 1),
                            running_lora_adapters=("y",))
    dp = DataParallelEngine.__new__(DataParallelEngine)
    dp.replicas = [SimpleNamespace(stats=lambda: a), SimpleNamespace(stats=lambda: b)]
    stats = dp.stats()
    assert stats.spec_num_accepted_tokens_per_pos == (5, 3, 1) and stats.running_lora_adapters == ("x", "y")


def test_a_predicted_output_is_taken_and_checked(server):
    body = {"model": "fake-model", "messages": MSG, "max_tokens": 3,
            "prediction": {"type": "content", "content": [{"type": "text", "text": "hello there"}]}}
    assert httpx.post(server.url + "/v1/chat/completions", json=body).status_code == 200
    for bad in ({"type": "content"}, {"type": "content", "content": 3}, "hello", {"type": "other", "content": "x"}):
        got = httpx.post(server.url + "/v1/chat/completions", json={**body, "prediction": bad})
        assert got.status_code == 400 and got.json()["error"]["param"] == "prediction", bad


def test_usage_counts_predicted_tokens():
    from jaxserve.outputs import CompletionOutput, RequestOutput
    from server.generation import Generation

    gen = Generation.__new__(Generation)
    gen.jobs = [SimpleNamespace(prompt_ids=[1, 2, 3])]
    done = [CompletionOutput(0, "ab", [5, 6], None, None, "length", accepted_prediction_tokens=1,
                             rejected_prediction_tokens=4),
            CompletionOutput(1, "cd", [7, 8], None, None, "length", accepted_prediction_tokens=0,
                             rejected_prediction_tokens=5)]
    gen.latest = [RequestOutput("r", None, [1, 2, 3], done, True)]
    usage = gen.usage()
    assert usage["completion_tokens"] == 4 and usage["prompt_tokens"] == 3
    assert usage["completion_tokens_details"] == {"accepted_prediction_tokens": 1, "rejected_prediction_tokens": 9}
    done[0].accepted_prediction_tokens = done[1].accepted_prediction_tokens = None
    assert "completion_tokens_details" not in gen.usage()
