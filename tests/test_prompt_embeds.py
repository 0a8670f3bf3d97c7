"""Prompts given as embeddings (`engine.prompt_embeds`, vLLM's `prompt_embeds` and `--enable-prompt-embeds`): a
prompt's embedding rows give what its token ids give (batched with token prompts, in chunks, and from the prefix
cache), transformers' `generate(inputs_embeds=...)`'s tokens for rows no token has, and over HTTP the same from a
base64 `torch.save`d tensor; what cannot be served is refused, named."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest

from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine_args import EngineArgs
from jaxserve.llm import LLM
from jaxserve.sampling_params import SamplingParams
from server.config import ServerConfig
from server.runner import serve_in_thread

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# 16-token chunks: a 40-row prompt of embeddings runs in three.
ARGS = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, max_model_len=96,
            kv_cache_memory_bytes=1 << 21, warmup=False, enable_prompt_embeds=True, enable_prefix_caching=True)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.test_draft_model import _with_tokenizer
    from tests.test_model_families import save_tiny_hf

    path = tmp_path_factory.mktemp("embeds")
    model = save_tiny_hf("LlamaConfig", path)
    return _with_tokenizer(str(path)), model


def _rows(model, ids):
    with torch.no_grad():
        return model.model.embed_tokens(torch.tensor(ids)).numpy()


def test_embeddings_give_what_their_tokens_give(tiny):
    path, model = tiny
    llm = LLM(path, progress=False, **ARGS)
    ids = np.random.default_rng(3).integers(2, 160, 40).tolist()
    want = llm.generate({"prompt_token_ids": ids}, GREEDY)[0].outputs[0]
    rows = _rows(model, ids)
    # Batched with a token prompt, and as a torch tensor; chunked (40 rows in 16-token steps).
    outs = llm.generate([{"prompt_embeds": rows}, {"prompt_token_ids": ids[:9]}, {"prompt_embeds": torch.tensor(rows)}],
                        GREEDY)
    for out in (outs[0], outs[2]):
        got = out.outputs[0]
        assert got.token_ids == want.token_ids and out.prompt_token_ids == [] and out.prompt is None
        np.testing.assert_allclose([next(iter(e.values())).logprob for e in got.logprobs],
                                   [next(iter(e.values())).logprob for e in want.logprobs], atol=1e-5)
    assert outs[1].outputs[0].token_ids == llm.generate({"prompt_token_ids": ids[:9]}, GREEDY)[0].outputs[0].token_ids
    # The second time, its pages came from the prefix cache (keyed by the rows' hash): the same tokens.
    hits = llm.engine.stats().prefix_cache_hits
    assert llm.generate({"prompt_embeds": rows}, GREEDY)[0].outputs[0].token_ids == want.token_ids
    assert llm.engine.stats().prefix_cache_hits >= hits + 32
    # Rows no token has: transformers' greedy tokens from the same embeddings.
    odd = (rows + np.random.default_rng(4).normal(0, 0.3, rows.shape)).astype(np.float32)
    with torch.no_grad():
        hf = model.generate(inputs_embeds=torch.tensor(odd[None]), max_new_tokens=8, do_sample=False, min_new_tokens=8,
                            pad_token_id=0)[0].tolist()
    assert llm.generate({"prompt_embeds": odd}, GREEDY)[0].outputs[0].token_ids == hf[-8:]
    llm.engine.check_integrity()


def test_what_is_refused(tiny):
    path, model = tiny
    llm = LLM(path, progress=False, **ARGS)
    rows = _rows(model, [5, 6, 7])
    for embeds, params, named in [
        (rows[:, :10], GREEDY, r"prompt_embeds has shape \(3, 10\); this model takes \[tokens >= 1, 64\]"),
        (rows[:0], GREEDY, "prompt_embeds has shape"),
        (np.where(rows > 0, np.inf, rows), GREEDY, "not finite"),
        (rows, SamplingParams(prompt_logprobs=1), "a prompt of embeddings has no tokens to score"),
    ]:
        with pytest.raises(ValueError, match=named):
            llm.engine.add_request("x", embeds, params)
    plain = LLMEngine(EngineArgs(model=path, **{**ARGS, "enable_prompt_embeds": False}), progress=False)
    with pytest.raises(ValueError, match="needs the engine started with enable_prompt_embeds"):
        plain.add_request("x", rows, GREEDY)
    with pytest.raises(ValueError, match="served by one process"):
        EngineArgs(enable_prompt_embeds=True, num_processes=2, coordinator_address="127.0.0.1:1")


def _b64(array) -> str:
    buf = io.BytesIO()
    torch.save(torch.tensor(array), buf)
    return base64.b64encode(buf.getvalue()).decode()


def test_over_http(tiny):
    path, model = tiny
    ids = [9, 8, 7, 6, 5, 4, 3]
    engine = AsyncEngine(LLMEngine(EngineArgs(model=path, **ARGS), progress=False))
    try:
        with serve_in_thread(engine, ServerConfig(port=0)) as srv:
            body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            want = httpx.post(f"{srv.url}/v1/completions", json={**body, "prompt": ids}, timeout=60).json()
            r = httpx.post(f"{srv.url}/v1/completions", timeout=60,
                           json={**body, "prompt_embeds": [_b64(_rows(model, ids)), _b64(_rows(model, ids[:4]))]})
            assert r.status_code == 200, r.text
            first, second = r.json()["choices"]
            # (the text decoded with no prompt tokens before it: the word-level tokenizer's leading space is not there)
            assert first["token_ids"] == want["choices"][0]["token_ids"]
            assert first["text"] == want["choices"][0]["text"].lstrip() and first["text"]
            assert first["prompt_token_ids"] == [] and r.json()["usage"]["prompt_tokens"] == len(ids) + 4
            assert second["index"] == 1 and len(second["token_ids"]) == 6
            with httpx.stream("POST", f"{srv.url}/v1/completions", timeout=60,
                              json={**body, "stream": True, "prompt_embeds": _b64(_rows(model, ids))}) as s:
                chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
            assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == first["text"]
            for sent, named in [({"prompt_embeds": "not base64!"}, "not a base64 torch.save'd tensor"),
                                ({"prompt_embeds": _b64(np.zeros((2, 3, 64), np.float32))}, "[tokens, hidden]"),
                                ({"prompt_embeds": _b64(np.zeros((2, 5), np.float32))}, "this model takes"),
                                ({"prompt_embeds": [_b64(_rows(model, ids))], "use_beam_search": True}, "beam")]:
                r = httpx.post(f"{srv.url}/v1/completions", json={**body, **sent}, timeout=60)
                assert r.status_code == 400 and named in r.text, (sent.keys(), r.text)
    finally:
        engine.shutdown()
