"""Lifecycle of a real server process: ready after load, SIGTERM drains in-flight streams, exit 0."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx

# A server process over the fake engine, as `jaxserve serve` runs it (run_server with a loader).
SCRIPT = """
import os, sys, time
from server.cli import setup_logging
from server.config import ServerConfig
from server.fake_engine import FakeAsyncEngine
from server.runner import run_server
from server.state import LoadingEngine

def load():
    while not os.path.exists(sys.argv[1]):  # "loading" until the test lets it finish
        time.sleep(0.01)
    return FakeAsyncEngine(step_delay=0.05)

setup_logging("info")
sys.exit(run_server(ServerConfig(port=0, shutdown_timeout=20), load, LoadingEngine("fake-model")))
"""


def _start(gate: str) -> tuple[subprocess.Popen, str, list[str]]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, gate], stderr=subprocess.PIPE, text=True, env=env,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    log: list[str] = []
    url = None
    deadline = time.monotonic() + 30
    while url is None and time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        log.append(line)
        m = re.search(r"listening on (http://\S+)", line)
        if m:
            url = m.group(1)
    assert url, "".join(log)
    threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()
    return proc, url, log


def test_sigterm_drains_streams_then_exits_zero(tmp_path):
    gate = tmp_path / "loaded"
    proc, url, log = _start(str(gate))
    try:
        assert httpx.get(url + "/health").status_code == 200
        r = httpx.get(url + "/ready")
        assert r.status_code == 503 and r.json() == {"status": "loading"}
        r = httpx.post(url + "/v1/completions", json={"prompt": "hello"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_ready"
        gate.touch()
        deadline = time.monotonic() + 20
        while httpx.get(url + "/ready").status_code != 200:
            assert time.monotonic() < deadline, "never became ready"
            time.sleep(0.05)

        results: dict[int, tuple[str, str | None, bool]] = {}
        started = threading.Barrier(4)

        def stream(i: int) -> None:
            body = {"prompt": "hello", "max_tokens": 12, "temperature": 0, "stream": True}
            text, finish, done = "", None, False
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
                lines = r.iter_lines()
                for n, line in enumerate(lines):
                    if n == 0:
                        started.wait(10)
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        choice = json.loads(line[6:])["choices"][0]
                        text += choice["text"]
                        finish = choice["finish_reason"] or finish
            results[i] = (text, finish, done)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        started.wait(10)  # every stream has its first chunk: all three are in flight
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while True:  # the signal is handled asynchronously: wait until the server says it drains
            refused = httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 1})
            if refused.status_code == 503 or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
        assert httpx.get(url + "/ready").status_code == 503
        for t in threads:
            t.join(30)
        expected = "one two three four five six seven eight nine ten eleven twelve"
        assert results == {i: (expected, "length", True) for i in range(3)}, results
        assert proc.wait(20) == 0, "".join(log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(log)
    assert "draining 3 request(s)" in text
    access = [json.loads(line.split("jaxserve.server.access: ", 1)[1]) for line in log if "server.access:" in line]
    streams = [a for a in access if a["path"] == "/v1/completions" and a["status"] == 200]
    assert len(streams) == 3 and all(a["completion_tokens"] == 12 and a["ttft_s"] > 0 for a in streams)
