"""`--logprobs-mode` through the engine and the server (the sampler's arithmetic is tested in test_sampler.py):
the mode reaches both the mixed step and the device decode loop, the tokens never change, and a token the
filters dropped (-inf) is written as -9999.0, as vLLM writes it, so the JSON stays valid."""

from __future__ import annotations

import argparse

import httpx
import pytest

from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine_args import EngineArgs
from jaxserve.sampling_params import SamplingParams
from server.config import ServerConfig
from server.runner import serve_in_thread
from tests.fake_model import fake_loaded_model
from tests.modelrun import drain

ARGS = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, page_size=8, num_scheduler_steps=4,
            compile_cache_dir=None, warmup=False, kv_cache_memory_bytes=2**20)
PROMPT = [5, 6, 7]
BIAS = {40: 2.0, 41: 1.0}  # ties broken: after the next token, 40 then 41 (the rest all at -15)


def _first_logprobs(mode: str) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Per request (a random one with top_k=2, a greedy one): its tokens and each position's logprobs."""
    engine = LLMEngine(EngineArgs(**ARGS, logprobs_mode=mode), loaded=fake_loaded_model(), progress=False)
    reqs = {"random": SamplingParams(temperature=0.5, top_k=2, seed=7, max_tokens=6, logprobs=3, ignore_eos=True,
                                     logit_bias=BIAS),
            "greedy": SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True, logit_bias={40: 3.0})}
    for rid, p in reqs.items():
        engine.add_request(rid, PROMPT, p)
    out = drain(engine)
    return [(list(out[r].outputs[0].token_ids),
             [{t: e.logprob for t, e in pos.items()} for pos in out[r].outputs[0].logprobs]) for r in reqs]


def test_each_mode_reports_its_values_in_both_step_kinds():
    raw, processed, logits = (_first_logprobs(m) for m in ("raw_logprobs", "processed_logprobs", "processed_logits"))
    assert [t for t, _ in raw] == [t for t, _ in processed] == [t for t, _ in logits] == [[8, 9, 10, 11, 12, 13]] * 2
    # The counting model: 15 on the next token, -15 elsewhere. Raw: the others at -30 below it, bias or not.
    for pos in raw[0][1]:
        assert sorted(pos.values(), reverse=True)[1:] == [pytest.approx(-30.0, abs=1e-3)] * 2
    # Processed, random row (bias, temperature 0.5, top-k 2): the next token and 40 are kept, 41 dropped.
    for pos in processed[0][1]:
        assert sorted(pos.values(), reverse=True) == [pytest.approx(0.0, abs=1e-6), pytest.approx(-56.0, abs=1e-3),
                                                      float("-inf")]
    for pos in logits[0][1]:  # logits over the temperature
        assert sorted(pos.values(), reverse=True) == [pytest.approx(30.0), pytest.approx(-26.0), float("-inf")]
    # Processed, greedy row: the bias shows (token 40 at -15 + 3), no temperature and no filter.
    assert all(pos[40] == pytest.approx(-12.0) for pos in logits[1][1])
    assert all(pos[40] == pytest.approx(-27.0, abs=1e-3) for pos in processed[1][1])


def test_dropped_tokens_are_minus_9999_over_http():
    engine = AsyncEngine(LLMEngine(EngineArgs(**ARGS, logprobs_mode="processed_logprobs"), loaded=fake_loaded_model(),
                                   progress=False))
    try:
        template = "{% for m in messages %}{{ m.content }}{% endfor %}"
        with serve_in_thread(engine, ServerConfig(port=0, chat_template=template)) as srv:
            bias = {str(t): b for t, b in BIAS.items()}
            body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0.5, "top_k": 2, "seed": 1, "logprobs": 3,
                    "logit_bias": bias}
            r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            tops = r.json()["choices"][0]["logprobs"]["top_logprobs"]
            assert all(sorted(t.values())[0] == -9999.0 for t in tops)
            chat = {"messages": [{"role": "user", "content": "t5 t6"}], "max_tokens": 2, "temperature": 0.5,
                    "top_k": 2, "logprobs": True, "top_logprobs": 3, "logit_bias": bias}
            r = httpx.post(f"{srv.url}/v1/chat/completions", json=chat, timeout=60)
            assert r.status_code == 200, r.text
            content = r.json()["choices"][0]["logprobs"]["content"]
            assert all(min(t["logprob"] for t in c["top_logprobs"]) == -9999.0 for c in content)
    finally:
        engine.shutdown()


def test_the_flag():
    ns = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(["--logprobs-mode", "processed_logits",
                                                                        "--max-logprobs", "5"])
    args = EngineArgs.from_cli_args(ns)
    assert (args.logprobs_mode, args.max_logprobs) == ("processed_logits", 5)
    with pytest.raises(ValueError, match="logprobs_mode must be one of raw_logprobs"):
        EngineArgs(logprobs_mode="logits")
