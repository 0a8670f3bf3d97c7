"""The router over fake-engine workers on 127.0.0.1: policies, prefix locality from KV events, load
shedding, dead workers, runtime registration, pass-through of streams and errors, traces."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from jaxserve.engine.kv_events import BlockStored, hash_token_pages
from router.app import build_router_app
from router.config import CostWeights, RouterConfig
from router.prefix_index import PrefixIndex
from router.timeline import format_timeline
from router.workers import WorkerPool, parse_metrics
from server.config import ServerConfig
from server.fake_engine import FakeAsyncEngine
from server.runner import ServerThread, serve_in_thread

# 40 words: two full pages of 16 tokens once the chat template's tokens are added.
SYSTEM = " ".join(["hello world one two three four five six seven eight"] * 4)


class EventFakeEngine(FakeAsyncEngine):
    """The fake engine plus a prefix cache's KV events: each prompt's full pages are stored on arrival."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self._subscribers = []
        self._stored: set[int] = set()
        self._tracer = None

    def subscribe_kv_events(self, callback) -> bool:
        self._subscribers.append(callback)
        return True

    def set_tracer(self, callback) -> None:
        self._tracer = callback

    def clear_cache(self) -> None:
        from jaxserve.engine.kv_events import AllBlocksCleared

        self._stored.clear()
        for cb in self._subscribers:
            cb(AllBlocksCleared())

    async def generate(self, prompt, sampling_params, request_id, *, priority=0, cache_salt=None):
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        hashes = tuple(hash_token_pages(ids[:-1], self._page_size, cache_salt))
        if hashes and not set(hashes) <= self._stored:
            self._stored.update(hashes)
            for cb in self._subscribers:
                cb(BlockStored(hashes, None, (), self._page_size))
        if self._tracer is not None:
            self._tracer(request_id, "L4", "queued", {"prompt_tokens": len(ids)})
        async for out in super().generate(prompt, sampling_params, request_id, priority=priority,
                                          cache_salt=cache_salt):
            yield out


def _chat(user: str, system: str = SYSTEM, **extra) -> dict:
    return {"model": "fake-model", "messages": [{"role": "system", "content": system},
                                                {"role": "user", "content": user}], "max_tokens": 3, "temperature": 0, **extra}


class Cluster:
    """Fake-engine workers in threads and a router in a thread."""

    def __init__(self, n: int = 2, engine_cls=EventFakeEngine, **router_kw):
        self.engines = [engine_cls(step_delay=0.001) for _ in range(n)]
        self.servers = [serve_in_thread(e, ServerConfig(port=0)) for e in self.engines]
        cfg = RouterConfig(port=0, workers=tuple(s.url for s in self.servers), probe_interval_s=0.05,
                           **router_kw)
        self.app = build_router_app(cfg)
        self.router = ServerThread(self.app, "127.0.0.1", 0).start()
        self.url = self.router.url
        self.client = httpx.Client(base_url=self.url, timeout=30)
        _wait(lambda: len(self.client.get("/workers").json()["workers"]) == n
              and all(w["healthy"] for w in self.client.get("/workers").json()["workers"]))

    def worker_of(self, resp: httpx.Response) -> int:
        return [s.url for s in self.servers].index(resp.headers["x-jaxserve-worker"])

    def close(self) -> None:
        self.client.close()
        self.router.stop()
        for s, e in zip(self.servers, self.engines, strict=True):
            s.stop()
            e.shutdown()


def _in_flight(cluster: Cluster) -> int:
    return sum(w["in_flight"] for w in cluster.client.get("/workers").json()["workers"])


def _wait(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.02)


@pytest.fixture
def cluster(request):
    kw = getattr(request, "param", {})
    c = Cluster(**kw)
    yield c
    c.close()


@pytest.mark.parametrize("cluster", [{"policy": "prefix"}], indirect=True)
def test_shared_system_prompt_lands_on_the_worker_holding_it(cluster):
    first = cluster.client.post("/v1/chat/completions", json=_chat("one"))
    assert first.status_code == 200
    home = cluster.worker_of(first)
    # Wait until the router has the worker's KV events (not just its routing-time guess).
    router = cluster.app.state.router
    _wait(lambda: router.index.num_exact(cluster.servers[home].url) >= 2)
    router.index._approx.clear()  # only the events may explain the picks below
    picks = []
    for i, user in enumerate(["two", "three", "four", "five", "six"]):
        r = cluster.client.post("/v1/chat/completions", json=_chat(user), headers={"x-request-id": f"shared-{i}"})
        assert r.status_code == 200
        picks.append(cluster.worker_of(r))
    assert picks == [home] * 5
    # The trace says why: the pick saw the cached pages in the exact index.
    trace = cluster.client.get("/v1/requests/shared-0/trace").json()["records"]
    pick = next(r for r in trace if r["event"] == "picked")["data"]
    mine = next(c for c in pick["candidates"] if c["url"] == cluster.servers[home].url)
    other = next(c for c in pick["candidates"] if c["url"] != cluster.servers[home].url)
    assert mine["matched_pages"] >= 2 and mine["index"] == "exact" and other["matched_pages"] == 0
    # A different system prompt matches no worker's pages, so nothing pins it to the prefix's home.
    r = cluster.client.post("/v1/chat/completions", json=_chat("x", system="system one two three"),
                            headers={"x-request-id": "other-0"})
    assert r.status_code == 200
    trace = cluster.client.get("/v1/requests/other-0/trace").json()["records"]
    pick = next(r for r in trace if r["event"] == "picked")["data"]
    assert [c["matched_pages"] for c in pick["candidates"]] == [0, 0]


@pytest.mark.parametrize("cluster", [{"policy": "prefix"}], indirect=True)
def test_a_responses_request_is_routed_as_its_chat_request(cluster):
    """`/v1/responses` goes through the router, to the worker holding the prefix its chat form shares."""
    first = cluster.client.post("/v1/chat/completions", json=_chat("one"))
    home = cluster.worker_of(first)
    router = cluster.app.state.router
    _wait(lambda: router.index.num_exact(cluster.servers[home].url) >= 2)
    router.index._approx.clear()
    for user in ("two", "three", "four", "five"):
        r = cluster.client.post("/v1/responses", json={"model": "fake-model", "instructions": SYSTEM, "input": user,
                                                       "max_output_tokens": 3})
        assert r.status_code == 200 and r.json()["object"] == "response" and cluster.worker_of(r) == home
    bad = cluster.client.post("/v1/responses", json={"model": "fake-model", "input": "x", "background": True,
                                                      "stream": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stream"


@pytest.mark.parametrize("cluster", [{"policy": "round-robin"}], indirect=True)
def test_a_continued_response_runs_on_the_worker_that_stores_it(cluster):
    """Each worker stores its own responses: the router sends a `previous_response_id` continuation, and GET,
    cancel and DELETE of a stored response, to the worker that stores it (round robin alone would alternate)."""
    body = {"model": "fake-model", "input": "one", "max_output_tokens": 3}
    first = cluster.client.post("/v1/responses", json=body)
    assert first.status_code == 200 and first.json()["store"]
    home, rid = cluster.worker_of(first), first.json()["id"]
    for _ in range(3):
        r = cluster.client.post("/v1/responses", json={**body, "input": "two", "previous_response_id": rid})
        assert r.status_code == 200 and cluster.worker_of(r) == home and r.json()["previous_response_id"] == rid
        rid = r.json()["id"]
    assert cluster.client.get(f"/v1/responses/{rid}").json()["id"] == rid
    listed = cluster.client.get(f"/v1/responses/{rid}/input_items", params={"order": "asc", "limit": 1}).json()
    assert [i["content"][0]["text"] for i in listed["data"]] == ["two"] and not listed["has_more"]
    # Cancel reaches the storing worker too, which refuses it for a finished response (another would 404).
    late = cluster.client.post(f"/v1/responses/{rid}/cancel")
    assert late.status_code == 400 and "only a background response" in late.json()["error"]["message"]
    assert cluster.client.delete(f"/v1/responses/{rid}").json()["deleted"] is True
    assert cluster.client.get(f"/v1/responses/{rid}").status_code == 404
    gone = cluster.client.post("/v1/responses", json={**body, "previous_response_id": rid})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "previous_response_id"


@pytest.mark.parametrize("cluster", [{"policy": "round-robin"}], indirect=True)
def test_a_conversation_lives_on_one_worker_and_its_responses_run_there(cluster):
    """A conversation is kept by the worker that created it: the router sends the responses that name it, and
    every call on it and its items, there (round robin alone would alternate)."""
    created = cluster.client.post("/v1/conversations", json={"items": [{"role": "user", "content": "one"}]})
    cid = created.json()["id"]
    kept = [httpx.get(f"{s.url}/v1/conversations/{cid}").status_code for s in cluster.servers]
    assert sorted(kept) == [200, 404]
    home = kept.index(200)
    for turn in ("two", "three"):
        r = cluster.client.post("/v1/responses", json={"model": "fake-model", "input": turn, "max_output_tokens": 3,
                                                       "conversation": {"id": cid}})
        assert r.status_code == 200 and cluster.worker_of(r) == home and r.json()["conversation"] == {"id": cid}
    items = cluster.client.get(f"/v1/conversations/{cid}/items", params={"order": "asc"}).json()["data"]
    assert [i["role"] for i in items] == ["user", "user", "assistant", "user", "assistant"]
    added = cluster.client.post(f"/v1/conversations/{cid}/items",
                                json={"items": [{"role": "user", "content": "four"}]}).json()["data"][0]
    assert cluster.client.get(f"/v1/conversations/{cid}/items/{added['id']}").json()["content"][0]["text"] == "four"
    assert cluster.client.delete(f"/v1/conversations/{cid}/items/{added['id']}").json()["id"] == cid
    assert cluster.client.post(f"/v1/conversations/{cid}", json={"metadata": {"k": "v"}}).json()["metadata"] == {"k": "v"}
    assert cluster.client.delete(f"/v1/conversations/{cid}").json()["deleted"] is True
    gone = cluster.client.get(f"/v1/conversations/{cid}")
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "conversation_id"


@pytest.mark.parametrize("cluster", [{"policy": "prefix", "engine_cls": FakeAsyncEngine}], indirect=True)
def test_cold_index_falls_back_to_routing_time_guess(cluster):
    # Plain fake engines publish no KV events: the approximate index alone keeps the prefix together.
    assert cluster.client.get(cluster.servers[0].url + "/v1/kv_events").status_code == 404
    picks = [cluster.worker_of(cluster.client.post("/v1/chat/completions", json=_chat(u)))
             for u in ("one", "two", "three", "four")]
    assert len(set(picks)) == 1
    trace_id = "cold-1"
    cluster.client.post("/v1/chat/completions", json=_chat("five"), headers={"x-request-id": trace_id})
    pick = next(r for r in cluster.client.get(f"/v1/requests/{trace_id}/trace").json()["records"]
                if r["event"] == "picked")["data"]
    assert {c["index"] for c in pick["candidates"]} == {"approx", ""}


@pytest.mark.parametrize("cluster", [{"policy": "prefix", "weights": CostWeights(hotspot_threshold=2)}],
                         indirect=True)
def test_overloaded_worker_sheds_its_prefix_traffic(cluster):
    first = cluster.client.post("/v1/chat/completions", json=_chat("one"))
    home = cluster.worker_of(first)
    cluster.engines[home].pause()  # its queue grows while requests wait
    with ThreadPoolExecutor(8) as pool:
        futures = []
        for i in range(6):
            futures.append(pool.submit(cluster.client.post, "/v1/chat/completions", json=_chat(f"q{i}")))
            # One at a time: the next is sent once the router has this one in flight (or done, on the other
            # worker), so each pick sees the previous ones.
            _wait(lambda n=i + 1: _in_flight(cluster) + sum(f.done() for f in futures) >= n)
        cluster.engines[home].resume()
        results = [f.result() for f in futures]
    assert all(r.status_code == 200 for r in results)
    picks = [cluster.worker_of(r) for r in results]
    # The home worker takes the prefix until its queue exceeds the other's by more than 2.
    assert picks[:3] == [home] * 3
    assert picks.count(1 - home) >= 2


@pytest.mark.parametrize("cluster", [{"policy": "least-load"}], indirect=True)
def test_killed_worker_fails_no_new_request_and_stops_getting_traffic(cluster):
    dead = cluster.servers[1]
    errors, picks = [], []
    stop = threading.Event()

    def client_loop():
        with httpx.Client(base_url=cluster.url, timeout=30) as c:
            while not stop.is_set():
                r = c.post("/v1/chat/completions", json=_chat("go"))
                (picks if r.status_code == 200 else errors).append(r.headers.get("x-jaxserve-worker", r.text))

    threads = [threading.Thread(target=client_loop) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    dead.stop()  # the process's HTTP server is gone: connections are refused
    killed_at = len(picks)
    time.sleep(0.6)
    stop.set()
    for t in threads:
        t.join()
    assert errors == []
    assert len(picks) > killed_at + 5
    workers = {w["url"]: w for w in cluster.client.get("/workers").json()["workers"]}
    assert workers[dead.url]["healthy"] is False
    # After the probe noticed, nothing more went to it.
    assert dead.url not in picks[killed_at + 3:]
    assert cluster.client.get("/ready").status_code == 200


@pytest.mark.parametrize("cluster", [{"policy": "round-robin"}], indirect=True)
def test_round_robin_streams_pass_through_chunk_by_chunk(cluster):
    picks = [cluster.worker_of(cluster.client.post("/v1/completions", json={"prompt": "one", "max_tokens": 2}))
             for _ in range(4)]
    assert picks in ([0, 1, 0, 1], [1, 0, 1, 0])
    body = {"prompt": "one two", "max_tokens": 5, "stream": True, "temperature": 0}

    def stream_texts(client, url):
        with client.stream("POST", url, json=body) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        return [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]]

    via_router = stream_texts(cluster.client, "/v1/completions")
    direct = stream_texts(cluster.client, cluster.servers[0].url + "/v1/completions")
    assert via_router == direct and len(via_router) == 5  # one chunk per token, not buffered into one
    # A client that leaves mid-stream: the worker's request is aborted and the router's count drops back.
    with cluster.client.stream("POST", "/v1/completions", json={**body, "max_tokens": 200, "ignore_eos": True}) as r:
        next(r.iter_lines())
    _wait(lambda: all(w["in_flight"] == 0 for w in cluster.client.get("/workers").json()["workers"]))
    _wait(lambda: sum(len(e.aborted) for e in cluster.engines) == 1)
    # Errors come back with the worker's status and JSON.
    bad = cluster.client.post("/v1/completions", json={"prompt": "one", "max_tokens": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    assert cluster.client.get("/v1/models").json()["data"][0]["id"] == "fake-model"


def test_embeddings_pass_through_to_both_workers(cluster):
    body = {"model": "fake-model", "input": ["one two", "three"], "encoding_format": "float"}
    via = cluster.client.post("/v1/embeddings", json=body)
    direct = cluster.client.post(cluster.servers[0].url + "/v1/embeddings", json=body)
    assert via.status_code == 200 and via.json()["data"] == direct.json()["data"]
    assert [len(d["embedding"]) for d in via.json()["data"]] == [8, 8]
    assert {cluster.worker_of(cluster.client.post("/v1/embeddings", json=body)) for _ in range(4)} == {0, 1}
    bad = cluster.client.post("/v1/embeddings", json={"input": []})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"
    rerank = {"query": "one", "documents": ["two", "one", "three"]}
    via, direct = (c.post(u + "/v1/rerank", json=rerank).json() for c, u in ((cluster.client, ""),
                                                                           (cluster.client, cluster.servers[1].url)))
    assert via["results"] == direct["results"] and via["results"][0]["index"] == 1


@pytest.mark.parametrize("cluster", [{"policy": "session"}], indirect=True)
def test_session_policy_is_sticky(cluster):
    for session in ("alice", "bob", "carol", "dave"):
        picks = {cluster.worker_of(cluster.client.post("/v1/completions", json={"prompt": "one", "max_tokens": 1},
                                                       headers={"x-session-id": session})) for _ in range(3)}
        assert len(picks) == 1


def test_workers_register_and_deregister_at_run_time():
    engine = EventFakeEngine()
    with serve_in_thread(engine, ServerConfig(port=0)) as extra:
        c = Cluster(1, policy="round-robin")
        try:
            r = c.client.post("/workers", json={"url": extra.url})
            assert r.status_code == 200 and r.json()["registered"]["healthy"] is True
            picks = {c.client.post("/v1/completions", json={"prompt": "one", "max_tokens": 1})
                     .headers["x-jaxserve-worker"] for _ in range(4)}
            assert picks == {c.servers[0].url, extra.url}
            assert c.client.request("DELETE", "/workers", json={"url": extra.url}).status_code == 200
            picks = {c.client.post("/v1/completions", json={"prompt": "one", "max_tokens": 1})
                     .headers["x-jaxserve-worker"] for _ in range(3)}
            assert picks == {c.servers[0].url}
            assert c.client.request("DELETE", "/workers", json={"url": extra.url}).status_code == 404
            assert c.client.post("/workers", json={"url": "not-a-url"}).status_code == 400
        finally:
            c.close()
    engine.shutdown()


def test_worker_kv_event_feed_numbers_events_and_restarts_with_a_new_epoch():
    engine = EventFakeEngine()
    with serve_in_thread(engine, ServerConfig(port=0)) as srv, httpx.Client(base_url=srv.url) as c:
        feed = c.get("/v1/kv_events", params={"since": 0}).json()
        assert feed["events"] == [] and feed["next"] == 0 and not feed["truncated"]
        c.post("/v1/chat/completions", json=_chat("one"))
        c.post("/v1/chat/completions", json=_chat("two"))  # same system pages: nothing new stored
        feed = c.get("/v1/kv_events", params={"since": 0}).json()
        assert [e["type"] for e in feed["events"]] == ["BlockStored"] * feed["next"]
        assert feed["next"] >= 1
        expected = hash_token_pages(engine.tokenizer.encode(
            engine.tokenizer.apply_chat_template(_chat("one")["messages"], add_generation_prompt=True))[:-1], 16)
        assert feed["events"][0]["block_hashes"] == expected
        later = c.get("/v1/kv_events", params={"since": feed["next"]}).json()
        assert later["events"] == [] and later["epoch"] == feed["epoch"]
        assert c.get("/v1/kv_events", params={"since": "x"}).status_code == 400
    engine.shutdown()


def test_parse_metrics_reads_the_vllm_gauges():
    text = ('# HELP x\nvllm:num_requests_running{model_name="m"} 3.0\n'
            'vllm:num_requests_waiting{model_name="m"} 7.0\nvllm:kv_cache_usage_perc{model_name="m"} 0.25\n'
            'vllm:cache_config_info{block_size="32",model_name="m",num_gpu_blocks="100"} 1.0\n')
    assert parse_metrics(text) == {"num_running": 3.0, "num_waiting": 7.0, "kv_usage": 0.25, "page_size": 32}


def _probe_pool(answers: list, threshold: int = 3) -> tuple[WorkerPool, object]:
    """A pool of one worker whose probes meet `answers` in order: an exception class to raise on
    `/ready`, or a status code for it (the other endpoints answer 200)."""
    pending = list(answers)

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path != "/ready":
            return httpx.Response(200, text="") if request.url.path == "/metrics" else httpx.Response(404)
        answer = pending.pop(0)
        if isinstance(answer, type):
            raise answer("probe", request=request)
        return httpx.Response(answer, json={})

    pool = WorkerPool(PrefixIndex(), probe_interval_s=60, failure_threshold=threshold)
    pool._client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    return pool, pool.register("http://w0")


def test_probe_timeouts_drop_a_worker_only_after_the_threshold_in_a_row():
    async def run():
        pool, w = _probe_pool([200, httpx.ReadTimeout, httpx.ReadTimeout, 200, httpx.ReadTimeout,
                               httpx.RemoteProtocolError, httpx.ReadTimeout, 200])
        seen = []
        for _ in range(8):
            await pool.probe(w)
            seen.append((w.healthy, w.probe_failures))
        await pool.stop()
        return seen, w

    seen, w = asyncio.run(run())
    # Two timeouts keep it (a pass resets the count); the third in a row drops it; a pass restores it.
    assert seen == [(True, 0), (True, 1), (True, 2), (True, 0), (True, 1), (True, 2), (False, 3), (True, 0)]
    assert w.last_error is None and w.to_json()["probe_failures"] == 0


@pytest.mark.parametrize("answer,error", [(httpx.ConnectError, "/ready: ConnectError"),
                                          (503, "/ready answered 503")])
def test_refused_or_not_ready_drops_a_worker_at_once(answer, error):
    async def run():
        pool, w = _probe_pool([200, answer], threshold=3)
        await pool.probe(w)
        assert w.healthy
        await pool.probe(w)
        await pool.stop()
        return w

    w = asyncio.run(run())
    assert not w.healthy and w.last_error == error


def test_probe_flags_reach_the_config():
    from router.cli import add_router_args, router_config_from_args

    cfg = router_config_from_args(add_router_args(argparse.ArgumentParser()).parse_args(
        ["--worker", "http://a:1", "--probe-timeout", "0.5", "--probe-failure-threshold", "5"]))
    assert (cfg.probe_timeout_s, cfg.probe_failure_threshold) == (0.5, 5)
    with pytest.raises(ValueError, match="probe_failure_threshold must be >= 1"):
        RouterConfig(probe_failure_threshold=0)
    with pytest.raises(ValueError, match="probe_timeout_s must be > 0"):
        RouterConfig(probe_timeout_s=0)


def test_router_process_end_to_end_with_joined_trace():
    engines = [EventFakeEngine(step_delay=0.001) for _ in range(2)]
    servers = [serve_in_thread(e, ServerConfig(port=0)) for e in engines]
    cmd = [sys.executable, "-m", "router", "--port", "0", "--policy", "prefix", "--probe-interval", "0.05",
           "--log-level", "warning"]
    for s in servers:
        cmd += ["--worker", s.url]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "listening on" in line, proc.stderr.read()
        url = line.split()[-1]
        with httpx.Client(base_url=url, timeout=30) as c:
            _wait(lambda: c.get("/ready").status_code == 200)
            r = c.post("/v1/chat/completions", json=_chat("one"), headers={"x-request-id": "proc-1"})
            assert r.status_code == 200 and r.headers["x-request-id"] == "proc-1"
            assert r.json()["choices"][0]["message"]["content"] == "one two three"
            records = c.get("/v1/requests/proc-1/trace").json()["records"]
        events = [(rec["layer"], rec["event"]) for rec in records]
        assert events[:2] == [("L2", "received"), ("L2", "picked")]
        assert ("L1", "received") in events and ("L4", "queued") in events
        assert events.index(("L2", "picked")) < events.index(("L1", "received")) < events.index(("L4", "queued"))
        times = [rec["t"] for rec in records]
        assert times == sorted(times)
        worker_side = {rec["where"] for rec in records if rec["layer"] in ("L1", "L4")}
        assert worker_side == {r.headers["x-jaxserve-worker"]}
        metrics = httpx.get(url + "/metrics").text
        assert f'jaxserve_router:requests_routed_total{{policy="prefix",worker="{r.headers["x-jaxserve-worker"]}"}} 1.0' \
            in metrics
        text = format_timeline("proc-1", records)
        assert "picked" in text and "candidate" in text and text.count("\n") >= len(records)
    finally:
        proc.terminate()
        proc.wait(10)
        for s, e in zip(servers, engines, strict=True):
            s.stop()
            e.shutdown()
