"""A model's sampling defaults from its generation_config.json (vLLM's `--generation-config`): read, merged with
overrides, and applied to the requests that leave a field out, over HTTP and in `LLM`."""

from __future__ import annotations

import argparse
import json
import re

import httpx
import pytest

from jaxserve.engine.model_loading import load_model
from jaxserve.engine_args import EngineArgs
from jaxserve.generation_config import sampling_defaults
from server.config import ServerConfig
from server.fake_engine import FakeAsyncEngine
from server.runner import serve_in_thread
from tests.test_load_dummy import _config_only

QWEN3_LIKE = {"bos_token_id": 1, "do_sample": True, "eos_token_id": [2, 3], "temperature": 0.6, "top_k": 20,
              "top_p": 0.95, "repetition_penalty": 1.0, "max_new_tokens": 64}


def _write(path, config: dict) -> str:
    (path / "generation_config.json").write_text(json.dumps(config))
    return str(path)


def test_sampling_defaults_read_as_vllm_reads_them(tmp_path):
    model = _write(tmp_path, QWEN3_LIKE)
    # The fields vLLM reads, where they differ from transformers' defaults (repetition_penalty 1.0 is one).
    assert sampling_defaults(model) == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_tokens": 64}
    assert sampling_defaults(_write(tmp_path, {**QWEN3_LIKE, "top_k": 50})).get("top_k") is None
    assert sampling_defaults(model, "vllm") == {}
    assert sampling_defaults(model, "vllm", {"temperature": 0.2}) == {"temperature": 0.2}
    assert sampling_defaults(model, "auto", {"top_p": 0.5})["top_p"] == 0.5
    other = tmp_path / "other"
    other.mkdir()
    assert sampling_defaults(model, _write(other, {"min_p": 0.1})) == {"min_p": 0.1}
    assert sampling_defaults(str(tmp_path / "model.gguf")) == {}  # no such file: none to read
    with pytest.raises(FileNotFoundError, match="no generation_config.json there"):
        sampling_defaults(model, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="'seed' is not a sampling default"):
        sampling_defaults(model, "auto", {"seed": 3})
    with pytest.raises(ValueError, match=re.escape("temperature must be >= 0 (0 = greedy), got -1")):
        sampling_defaults(model, "auto", {"temperature": -1})


def test_a_gguf_files_sampling_metadata(tmp_path):
    """llama.cpp's converter writes the generation config's sampling fields as `general.sampling.*`."""
    import gguf

    path = str(tmp_path / "model.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_float32("general.sampling.temp", 0.7)
    writer.add_int32("general.sampling.top_k", 20)
    writer.add_float32("general.sampling.top_p", 0.8)
    writer.add_float32("general.sampling.penalty_repeat", 1.05)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    got = sampling_defaults(path)
    assert got.keys() == {"temperature", "top_k", "top_p", "repetition_penalty"} and got["top_k"] == 20
    assert got["temperature"] == pytest.approx(0.7) and got["repetition_penalty"] == pytest.approx(1.05)
    assert sampling_defaults(path, "vllm") == {}


def test_the_engine_loads_them_and_the_flags_set_them(tmp_path):
    path = _config_only(str(tmp_path / "model"))
    _write(tmp_path / "model", QWEN3_LIKE)
    loaded = load_model(EngineArgs(model=path, load_format="dummy"), progress=False)
    assert loaded.sampling_defaults == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_tokens": 64}
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(
        [path, "--generation-config", "vllm", "--override-generation-config", '{"top_p": 0.5}']))
    assert (args.generation_config, args.override_generation_config) == ("vllm", {"top_p": 0.5})
    loaded = load_model(args.replace(load_format="dummy"), progress=False)
    assert loaded.sampling_defaults == {"top_p": 0.5}


def test_requests_get_the_models_defaults_for_what_they_leave_out():
    engine = FakeAsyncEngine(step_delay=0.001)
    engine.sampling_defaults = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_tokens": 5}
    try:
        with serve_in_thread(engine, ServerConfig(port=0)) as srv:
            def params(rid: str, path: str, body: dict):
                r = httpx.post(srv.url + path, json=body, headers={"X-Request-Id": rid}, timeout=10)
                assert r.status_code == 200, r.text
                return [s[2] for s in engine.submitted if s[0] == rid or s[0].startswith(rid + "-")]

            chat = {"messages": [{"role": "user", "content": "hello"}]}
            p = params("d-1", "/v1/chat/completions", chat)[0]
            assert (p.temperature, p.top_k, p.top_p, p.max_tokens) == (0.6, 20, 0.95, 5)
            p = params("d-2", "/v1/completions", {"prompt": "hello", "temperature": 0, "top_p": None,
                                                  "max_tokens": 50})[0]
            assert (p.temperature, p.top_k, p.top_p, p.max_tokens) == (0.0, 20, 0.95, 5)  # the cap holds too
            # A beam search ranks by the model's own logprobs: no defaults, and not refused for them.
            beams = params("d-3", "/v1/completions", {"prompt": "hello", "use_beam_search": True, "n": 2,
                                                      "max_tokens": 2})
            assert beams and all(b.top_k == 0 and b.top_p == 1.0 for b in beams)
    finally:
        engine.shutdown()
