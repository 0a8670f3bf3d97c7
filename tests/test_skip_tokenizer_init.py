"""`skip_tokenizer_init` (vLLM's `--skip-tokenizer-init`) and `SamplingParams.detokenize`: an engine without a
tokenizer takes token ids and gives token ids, the same ones the engine with its tokenizer gives, ends generation at
the EOS ids its checkpoint names, and refuses by name what only a tokenizer can do, in Python and over HTTP."""

from __future__ import annotations

import argparse
import json
import shutil

import httpx
import pytest

from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine_args import EngineArgs
from jaxserve.llm import LLM
from jaxserve.loader import GGUFFile, HFDirectory, checkpoint_eos_ids
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import Tokenizer
from server.config import ServerConfig
from server.runner import serve_in_thread

ARGS = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
            kv_cache_memory_bytes=1 << 20, warmup=False)
PROMPT = [5, 7, 9, 11]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=1)


@pytest.fixture(scope="module")
def want(tiny_llama):
    """The engine with its tokenizer: the output of PROMPT, and the same asked not to detokenize."""
    llm = LLM(tiny_llama, progress=False, **ARGS)
    out = llm.generate({"prompt_token_ids": PROMPT}, PARAMS)[0]
    bare = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(**{**_fields(PARAMS), "detokenize": False}))[0]
    return out, bare


def _fields(params: SamplingParams) -> dict:
    return {k: getattr(params, k) for k in ("temperature", "max_tokens", "ignore_eos", "logprobs", "prompt_logprobs")}


def _same_numbers(got, out) -> None:
    """The same token ids and logprobs as `out`, no text anywhere."""
    g, o = got.outputs[0], out.outputs[0]
    assert g.token_ids == o.token_ids and len(o.token_ids) == 8 and o.text  # (the tokenizer's engine wrote text)
    assert g.text == "" and g.finish_reason == o.finish_reason == "length"
    for entries, theirs in ((g.logprobs, o.logprobs), (got.prompt_logprobs[1:], out.prompt_logprobs[1:])):
        for mine, ref in zip(entries, theirs, strict=True):
            assert mine.keys() == ref.keys()
            assert all(mine[t].logprob == pytest.approx(ref[t].logprob, abs=1e-6) for t in mine)
            assert all(e.decoded_token is None for e in mine.values())
            assert all(e.decoded_token is not None for e in ref.values())


def test_detokenize_false_gives_the_ids_without_text(want):
    out, bare = want
    _same_numbers(bare, out)
    with pytest.raises(ValueError, match="stop strings .* need detokenize=True"):
        SamplingParams(stop=["t9"], detokenize=False)


def test_an_engine_without_a_tokenizer_gives_the_same_ids_and_refuses_text(tiny_llama, want):
    llm = LLM(tiny_llama, skip_tokenizer_init=True, progress=False, **ARGS)
    assert llm.get_tokenizer() is None
    _same_numbers(llm.generate({"prompt_token_ids": PROMPT}, PARAMS)[0], want[0])
    ids = dict(max_tokens=4)
    for prompt, params, named in [
        ("t5 t7", SamplingParams(**ids), "a text prompt"),
        (PROMPT, SamplingParams(stop=["t9"], **ids), "stop strings"),
        (PROMPT, SamplingParams(bad_words=["t9"], **ids), "bad_words"),
        (PROMPT, SamplingParams(structured_outputs={"regex": "t[0-9]"}, **ids), "structured outputs"),
        (PROMPT, SamplingParams(prediction="t5 t7", **ids), "a text prediction"),
    ]:
        with pytest.raises(ValueError, match=f"{named}.* needs the tokenizer; the engine was started without"):
            llm.engine.add_request("x", prompt, params)
    with pytest.raises(ValueError, match="chat .* needs the tokenizer"):
        llm.chat([{"role": "user", "content": "t5"}], SamplingParams(**ids))
    # Stop token ids and a prediction of ids need no tokenizer.
    stop_at = want[0].outputs[0].token_ids[3]
    got = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                                     stop_token_ids=[stop_at]))[0].outputs[0]
    first = want[0].outputs[0].token_ids.index(stop_at)
    assert got.token_ids == want[0].outputs[0].token_ids[:first + 1] and got.stop_reason == stop_at
    llm.engine.check_integrity()


def test_generation_ends_at_the_checkpoints_eos_ids(tiny_llama, want, tmp_path):
    """Without the tokenizer, EOS comes from config.json and generation_config.json: generation stops at the first
    token that one of them names."""
    tokens = want[0].outputs[0].token_ids
    path = tmp_path / "model"
    shutil.copytree(tiny_llama, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "eos_token_id": 60}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [61, tokens[5]]}))
    assert checkpoint_eos_ids(str(path), HFDirectory(str(path), weights=False)) == (60, 61, tokens[5])
    llm = LLM(str(path), skip_tokenizer_init=True, progress=False, **ARGS)
    got = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    end = next(i for i, t in enumerate(tokens) if t in (60, 61, tokens[5]))
    assert got.token_ids == tokens[:end + 1] and got.finish_reason == "stop" and got.text == ""


def test_a_gguf_files_eos_ids_without_its_tokenizer(smollm_path):
    ids = checkpoint_eos_ids(smollm_path, GGUFFile(smollm_path))
    assert ids == Tokenizer.from_gguf(smollm_path).eos_token_ids and ids  # the file's EOS and its turn end


def test_the_flag_and_its_refusals():
    ns = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(["--skip-tokenizer-init"])
    assert EngineArgs.from_cli_args(ns).skip_tokenizer_init is True
    with pytest.raises(ValueError, match="a tokenizer was given too"):
        EngineArgs(skip_tokenizer_init=True, tokenizer="/some/where")
    with pytest.raises(ValueError, match="calculate_kv_scales tokenizes its calibration texts"):
        EngineArgs(skip_tokenizer_init=True, kv_cache_dtype="fp8", calculate_kv_scales=True)


def test_over_http_token_ids_in_and_out(tiny_llama, want):
    engine = AsyncEngine(LLMEngine(EngineArgs(model=tiny_llama, skip_tokenizer_init=True, **ARGS), progress=False))
    tokens = want[0].outputs[0].token_ids
    try:
        with serve_in_thread(engine, ServerConfig(port=0)) as srv:
            body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 1,
                    "return_token_ids": True}
            r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["text"] == "" and choice["token_ids"] == tokens and choice["prompt_token_ids"] == PROMPT
            assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in tokens]
            with httpx.stream("POST", f"{srv.url}/v1/completions", json={**body, "stream": True}, timeout=60) as s:
                chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
            assert [t for c in chunks for t in c["choices"][0].get("token_ids") or []] == tokens
            for path, sent, named in [
                ("/v1/completions", {"prompt": "t5 t7"}, "a text prompt"),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t5"}]}, "a chat"),
                ("/tokenize", {"prompt": "t5"}, "/tokenize"),
                ("/v1/completions", {"prompt": PROMPT, "stop": ["t9"]}, "stop strings"),
            ]:
                r = httpx.post(f"{srv.url}{path}", json=sent, timeout=60)
                assert r.status_code == 400 and named in r.text and "tokenizer" in r.text, (path, r.text)
    finally:
        engine.shutdown()
