"""Beam search over HTTP (vLLM's `use_beam_search`) on the fake engine, whose next-token logprobs are known
by hand: every position's most likely words are "one" (-0.25), "two" (-1.25), "three" (-2.25), ..."""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest

from server.config import ServerConfig
from server.fake_engine import FakeAsyncEngine
from server.runner import serve_in_thread

MSG = [{"role": "user", "content": "hello"}]
BEAM = {"use_beam_search": True}


@pytest.fixture(scope="module")
def engine():
    eng = FakeAsyncEngine(step_delay=0.001)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    with serve_in_thread(engine, ServerConfig(port=0)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _wait(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return False


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
