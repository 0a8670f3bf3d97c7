"""Bad input, auth, admission limits and disconnects, over a real Hypercorn server on the fake engine."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import openai
import pytest

from server.config import ServerConfig
from server.fake_engine import FakeAsyncEngine
from server.runner import serve_in_thread

MSG = [{"role": "user", "content": "hello"}]
CHAT, COMP = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def engine():
    eng = FakeAsyncEngine(step_delay=0.001, max_model_len=64)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    config = ServerConfig(port=0, max_request_body_bytes=4096)
    with serve_in_thread(engine, config) as srv:
        yield srv


LONG = " ".join(["hello"] * 70)

# (path, raw body or JSON object, status, param, code)
MALFORMED = [
    (CHAT, b"{not json", 400, None, "invalid_json"),
    (CHAT, b"", 400, None, "invalid_json"),
    (CHAT, b"[1, 2]", 400, None, "invalid_type"),
    (CHAT, {}, 400, "messages", "missing_required_parameter"),
    (CHAT, {"messages": "hi"}, 400, "messages", "invalid_value"),
    (CHAT, {"messages": []}, 400, "messages", "invalid_value"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "invalid_type"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]}]},
     400, "messages[0].content[0].type", "unsupported_content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages[0].content[0].image_url", "invalid_type"),
    # A text model: the image is refused once the conversation is rendered.
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages", "invalid_messages"),
    (CHAT, {"messages": MSG, "model": "gpt-4"}, 404, "model", "model_not_found"),
    (CHAT, {"messages": MSG, "temperature": "warm"}, 400, "temperature", "invalid_type"),
    (CHAT, {"messages": MSG, "temperature": -0.5}, 400, "temperature", "invalid_value"),
    (CHAT, {"messages": MSG, "top_p": 1.5}, 400, "top_p", "invalid_value"),
    (CHAT, {"messages": MSG, "top_k": -2}, 400, "top_k", "invalid_value"),
    (CHAT, {"messages": MSG, "n": 0}, 400, "n", "invalid_value"),
    (CHAT, {"messages": MSG, "max_tokens": -1}, 400, "max_tokens", "invalid_value"),
    (CHAT, {"messages": MSG, "max_completion_tokens": "ten"}, 400, "max_completion_tokens", "invalid_type"),
    (CHAT, {"messages": MSG, "max_tokens": 60}, 400, "max_tokens", "context_length_exceeded"),
    (CHAT, {"messages": [{"role": "user", "content": LONG}]}, 400, "messages", "context_length_exceeded"),
    (CHAT, {"messages": MSG, "stream": "yes"}, 400, "stream", "invalid_type"),
    (CHAT, {"messages": MSG, "stream_options": {"include_usage": True}}, 400, "stream_options", "invalid_value"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs", "invalid_value"),
    (CHAT, {"messages": MSG, "stop": [1]}, 400, "stop", "invalid_type"),
    (CHAT, {"messages": MSG, "seed": 1.5}, 400, "seed", "invalid_type"),
    (CHAT, {"messages": MSG, "logit_bias": {"five": 10}}, 400, "logit_bias", "invalid_value"),
    (CHAT, {"messages": MSG, "logit_bias": {"5": "up"}}, 400, "logit_bias", "invalid_type"),
    (CHAT, {"messages": MSG, "logit_bias": {"100000": 5}}, 400, "logit_bias", "invalid_value"),
    (COMP, {"prompt": "hello", "logit_bias": {str(i): 1 for i in range(129)}}, 400, "logit_bias", "invalid_value"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice",
     "unsupported_parameter"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice", "invalid_value"),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema"}}, 400, "response_format",
     "invalid_value"),
    (COMP, {"prompt": "hello", "structured_outputs": {"json": {"type": "object", "properties": 3}}}, 400,
     "structured_outputs", "invalid_value"),
    (CHAT, {"messages": MSG, "chat_template_kwargs": [1]}, 400, "chat_template_kwargs", "invalid_type"),
    (COMP, {}, 400, "prompt", "missing_required_parameter"),
    (COMP, {"prompt": 5}, 400, "prompt", "invalid_type"),
    (COMP, {"prompt": [10**9]}, 400, "prompt", "invalid_value"),
    (COMP, {"prompt": "hello", "logprobs": 99}, 400, "logprobs", "invalid_value"),
    (COMP, {"prompt": "hello", "suffix": "x"}, 400, "suffix", "unsupported_parameter"),
    (COMP, {"prompt": "hello", "best_of": 3}, 400, "best_of", "unsupported_parameter"),
    (COMP, {"prompt": "hello", "use_beam_search": "yes"}, 400, "use_beam_search", "invalid_type"),
    (CHAT, {"messages": MSG, "use_beam_search": True, "n": 11}, 400, "n", "invalid_value"),
    (COMP, {"prompt": LONG}, 400, "prompt", "context_length_exceeded"),
    (COMP, {"prompt": "hello", "max_tokens": 64}, 400, "max_tokens", "context_length_exceeded"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens", "invalid_value"),
    ("/tokenize", {}, 400, "prompt", "missing_required_parameter"),
    ("/v1/nope", {}, 404, None, "not_found"),
]


@pytest.mark.parametrize("path, body, status, param, code", MALFORMED,
                         ids=[f"{i}-{m[0].rsplit('/', 1)[-1]}-{m[3]}" for i, m in enumerate(MALFORMED)])
def test_malformed_request_gets_openai_error(server, path, body, status, param, code):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["code"] == code and err["message"]
    assert err["type"] == "invalid_request_error"
    if code == "context_length_exceeded":
        assert "64" in err["message"], "the message gives the context length"


def test_still_serving_after_the_bad_requests(server):
    r = httpx.post(server.url + COMP, json={"prompt": "hello", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "one two"
    assert httpx.get(server.url + "/v1/nope").status_code == 404
    assert httpx.get(server.url + CHAT).status_code == 405


def test_body_size_cap(server):
    big = {"prompt": "x" * 5000}
    r = httpx.post(server.url + COMP, json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'

    r = httpx.post(server.url + COMP, content=chunks())  # chunked: no content-length to check up front
    assert r.status_code == 413


def test_request_id_length_bounded(server):
    r = httpx.post(server.url + COMP, json={"prompt": "hello", "max_tokens": 1}, headers={"X-Request-Id": "a" * 300})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id"


def test_engine_failure_mid_stream_is_an_sse_error_then_done(server):
    body = {"prompt": "hello explode", "max_tokens": 10, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + COMP, json=body) as r:
        assert r.status_code == 200
        raw = "".join(r.iter_text())
    events = [b[6:] for b in raw.split("\n\n") if b]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["type"] == "server_error" and "failed" in err["message"]
    r = httpx.post(server.url + COMP, json={"prompt": "hello explode", "max_tokens": 10})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"


def _pages_in_use(server) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("vllm:kv_cache_usage_perc{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no kv_cache_usage_perc")


def _wait(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_stream_disconnect_aborts_and_frees_pages(server, engine):
    engine.step_delay = 0.02
    try:
        body = {"prompt": "hello", "max_tokens": 60, "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", server.url + COMP, json=body, headers={"X-Request-Id": "leaver-1"}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            assert _pages_in_use(server) > 0
        # Leaving the block closes the connection mid-stream.
        assert _wait(lambda: "leaver-1" in engine.aborted), engine.aborted
        assert _wait(lambda: _pages_in_use(server) == 0.0)
        assert _wait(lambda: not server.state.active)
    finally:
        engine.step_delay = 0.001


def test_non_stream_disconnect_aborts(server, engine):
    engine.pause()
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            body = json.dumps({"prompt": "hello", "max_tokens": 5}).encode()
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"X-Request-Id: leaver-2\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            assert _wait(lambda: engine.stats().num_waiting == 1)
        assert _wait(lambda: "leaver-2" in engine.aborted), engine.aborted
        assert engine.stats().num_waiting == 0
    finally:
        engine.resume()


def test_queue_limit_answers_429(engine):
    with serve_in_thread(engine, ServerConfig(port=0, max_waiting_requests=2)) as srv:
        engine.pause()
        results = []

        def send():
            results.append(httpx.post(srv.url + COMP, json={"prompt": "hello", "max_tokens": 2}, timeout=10))

        threads = [threading.Thread(target=send) for _ in range(2)]
        try:
            for t in threads:
                t.start()
            assert _wait(lambda: len(srv.state.active) == 2)
            r = httpx.post(srv.url + COMP, json={"prompt": "hello", "max_tokens": 2})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
        finally:
            engine.resume()
            for t in threads:
                t.join()
        assert [x.status_code for x in results] == [200, 200], "queued requests complete once admitted"


def test_not_ready_answers_503():
    eng = FakeAsyncEngine(ready=False)
    try:
        with serve_in_thread(eng) as srv:
            assert httpx.get(srv.url + "/health").status_code == 200
            r = httpx.get(srv.url + "/ready")
            assert r.status_code == 503 and "retry-after" in r.headers
            r = httpx.post(srv.url + COMP, json={"prompt": "hello"})
            assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"
            eng.is_ready = True
            assert httpx.get(srv.url + "/ready").status_code == 200
            assert httpx.post(srv.url + COMP, json={"prompt": "hello", "max_tokens": 1}).status_code == 200
    finally:
        eng.shutdown()


def test_api_key(engine):
    with serve_in_thread(engine, ServerConfig(port=0, api_key="s3cret")) as srv:
        bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        r = httpx.post(srv.url + COMP, json={"prompt": "hello", "max_tokens": 1})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.post(srv.url + "/tokenize", json={"prompt": "one"}).status_code == 401
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model="fake-model", prompt="hello", max_tokens=2,
                                       temperature=0).choices[0].text == "one two"
        for open_path in ("/health", "/ready", "/metrics"):
            assert httpx.get(srv.url + open_path).status_code == 200
