"""`jaxserve serve` across two processes on 127.0.0.1 (one CPU device each, gloo collectives, TP=2):
process 0 serves HTTP and leads, process 1 follows without a server. A completion sent to process 0
equals a single-process run of the same model, also after the cluster has idled; SIGTERM to process 0
stops both, each with exit code 0."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.fake_model import text
from tests.test_multihost import free_port
from tests.test_sharding_worker import ROOT, dense_config

PROMPT = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]  # one full page of 8, then 3
MAX_TOKENS = 8
# One sequence and no warmup: each process compiles only the two steps the request uses.
FLAGS = ["--dtype", "float32", "--max-num-seqs", "1", "--max-num-batched-tokens", "16", "--max-model-len", "64",
         "--page-size", "8", "--kv-cache-memory-bytes", str(2 * 2 * 64 * 8 * 2 * 16 * 4),
         "--num-scheduler-steps", "4", "--no-warmup", "--compile-cache-dir", "~/.cache/jaxserve/jax-tests"]
START_TIMEOUT_S = 240
STOP_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A tiny random-weight HF checkpoint (8 query heads, 2 KV heads: TP=2 splits both)."""
    import jax

    from jaxserve.loader.export import export_hf
    from jaxserve.models.params import init_params
    from tests.fake_model import fake_tokenizer

    path = str(tmp_path_factory.mktemp("tiny-hf"))
    cfg = dense_config()
    export_hf(path, cfg, init_params(cfg, jax.random.PRNGKey(1), scale=0.1), fake_tokenizer())  # (no special token)
    return path


def _single_process_tokens(model_dir: str) -> list[int]:
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine_args import EngineArgs
    from jaxserve.sampling_params import SamplingParams
    from server.cli import add_serve_args

    # The servers' own flags, parsed the same way, on one process and one device.
    ns = add_serve_args(argparse.ArgumentParser()).parse_args([model_dir, *FLAGS])
    engine = LLMEngine(EngineArgs.from_cli_args(ns), progress=False)
    engine.add_request("ref", PROMPT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    while engine.has_unfinished_requests():
        outs = [o for o in engine.step() if o.finished]
        if outs:
            return outs[0].outputs[0].token_ids
    raise AssertionError("the reference request never finished")


def _logs(procs: list[subprocess.Popen]) -> str:
    parts = []
    for i, p in enumerate(procs):
        if p.poll() is None:
            p.kill()
        out, _ = p.communicate(timeout=10)
        parts.append(f"--- process {i} (rc {p.returncode}) ---\n{out[-4000:]}")
    return "\n".join(parts)


def test_two_process_server_serves_single_process_tokens_and_stops_cleanly(model_dir):
    coordinator, http_port = free_port(), free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    procs = [subprocess.Popen([sys.executable, "-m", "server", model_dir, *FLAGS, "-tp", "2",
                               "--num-processes", "2", "--process-id", str(i),
                               "--coordinator-address", f"127.0.0.1:{coordinator}",
                               "--host", "127.0.0.1", "--port", str(http_port), "--served-model-name", "tiny"],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    try:
        want = _single_process_tokens(model_dir)  # while the cluster starts
        assert 0 not in want and 1 not in want, "the reference hit a special token; pick another prompt"
        url = f"http://127.0.0.1:{http_port}"
        with httpx.Client(base_url=url, timeout=120) as client:
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:
                assert all(p.poll() is None for p in procs), "a process exited while starting"
                assert time.monotonic() < deadline, "the cluster did not become ready in time"
                try:
                    if client.get("/ready").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True}
            first = client.post("/v1/completions", json=body)
            assert first.status_code == 200, first.text
            # Idle for a few broadcast periods, then again: the first page now hits the prefix cache,
            # which process 1 must hold too, or the two processes would schedule different steps.
            time.sleep(2.5)
            second = client.post("/v1/completions", json=body)
            assert second.status_code == 200, second.text
        for resp, cached in ((first, 0), (second, 8)):
            data = resp.json()
            assert data["choices"][0]["text"] == text(want)
            assert data["usage"]["completion_tokens"] == MAX_TOKENS
            assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
        procs[0].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=STOP_TIMEOUT_S) for p in procs]
    except BaseException:
        print(_logs(procs))
        raise
    logs = _logs(procs)
    assert codes == [0, 0], logs
    assert "following process 0" in logs and "process 0 stopped" in logs
