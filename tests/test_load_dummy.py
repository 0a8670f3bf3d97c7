"""`--load-format dummy`: random weights of a model's shapes, read from a directory that holds only its
config and tokenizer; served by the engine like real ones, deterministic by seed, and made directly in
their shards at TP=2 (two simulated CPU devices, in a child process)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.engine.model_loading import load_model
from jaxserve.engine_args import EngineArgs
from jaxserve.models.params import ParamInfo, declare_params, param_paths
from tests.test_converted_checkpoint import _export, _leaves
from tests.test_sharding_worker import RESULT_PREFIX, dense_config, run_module


def _config_only(path: str) -> str:
    """`jaxserve convert --config-only` of an HF directory of `dense_config()`: its config and tokenizer."""
    from jaxserve import cli

    source = _export(path + "-source", dense_config())
    assert cli.main(["convert", source, "--to-hf", path, "--config-only"]) == 0
    assert not [f for f in os.listdir(path) if "safetensors" in f]
    return path


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory) -> str:
    return _config_only(str(tmp_path_factory.mktemp("config-only")))


def test_dummy_weights_have_the_declared_shapes_and_initializers(config_dir):
    loaded = load_model(EngineArgs(model=config_dir, dtype="bfloat16", load_format="dummy", seed=5),
                        progress=False)
    assert loaded.config == dense_config()
    decl = param_paths(declare_params(dense_config()))
    got = param_paths(loaded.params)
    assert sorted(got) == sorted(decl)
    for name, info in decl.items():
        assert isinstance(info, ParamInfo)
        leaf = got[name]
        assert leaf.shape == info.shape and leaf.dtype == jnp.bfloat16, name
        values = np.asarray(leaf, np.float32)
        if info.init == "ones":
            assert np.all(values == 1.0), name
        elif info.init == "zeros":
            assert np.all(values == 0.0), name
        else:
            assert 0.015 < values.std() < 0.025 and abs(values.mean()) < 0.005, (name, values.std(), values.mean())
    # Every matrix has its own draw.
    assert not np.array_equal(np.asarray(got["layers.wk"]), np.asarray(got["layers.wv"]))


def test_dummy_weights_follow_the_seed(config_dir):
    def draw(seed: int) -> dict[str, np.ndarray]:
        args = EngineArgs(model=config_dir, dtype="float32", load_format="dummy", seed=seed)
        return _leaves(load_model(args, progress=False).params)

    a, b, c = draw(0), draw(0), draw(1)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["layers.wq"], c["layers.wq"])


def test_config_only_directory_needs_dummy(config_dir):
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights"):
        load_model(EngineArgs(model=config_dir, dtype="float32"), progress=False)


def test_engine_serves_dummy_weights(config_dir):
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.sampling_params import SamplingParams

    args = EngineArgs(model=config_dir, dtype="float32", load_format="dummy", max_num_seqs=4,
                      max_num_batched_tokens=32, max_model_len=64, kv_cache_memory_bytes=1 << 20,
                      warmup=False, compile_cache_dir=None)
    engine = LLMEngine(args, progress=False)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", list(range(3, 10 + 3 * i)), params)
    finished = {}
    for _ in range(100):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        if not engine.has_unfinished_requests():
            break
    engine.check_integrity()
    assert {k: len(v) for k, v in finished.items()} == {"r0": 6, "r1": 6, "r2": 6}


def test_config_only_export_of_the_bundled_gguf(tmp_path):
    pytest.importorskip("gguf")
    from jaxserve import cli
    from jaxserve.loader import bundled_model_path, checkpoint_tokenizer, open_checkpoint

    try:
        gguf_path = bundled_model_path()
    except FileNotFoundError:
        pytest.skip("the bundled SmolLM2 is not installed")
    out = str(tmp_path / "smollm2-config")
    assert cli.main(["convert", gguf_path, "--to-hf", out, "--config-only"]) == 0
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "special_tokens_map.json",
                                       "tokenizer.json", "tokenizer_config.json"]
    source = open_checkpoint(gguf_path)
    assert open_checkpoint(out, weights=False).config() == source.config()
    ours, theirs = checkpoint_tokenizer(out, open_checkpoint(out, weights=False)), checkpoint_tokenizer(gguf_path, source)
    conv = [{"role": "user", "content": "What is the capital of France? 東京 🚀"}]
    assert ours.encode_chat(conv, add_generation_prompt=True) == theirs.encode_chat(conv, add_generation_prompt=True)


def test_dummy_weights_of_the_bundled_gguf_are_never_read_from_it(monkeypatch):
    """A GGUF model with dummy weights: its config and tokenizer, random weights of its shapes, and the
    converter never called."""
    pytest.importorskip("gguf")
    from jaxserve.engine import model_loading
    from jaxserve.loader import bundled_model_path

    try:
        path = bundled_model_path()
    except FileNotFoundError:
        pytest.skip("the bundled SmolLM2 is not installed")

    def refuse(*args, **kwargs):
        raise AssertionError("the weights were read")

    monkeypatch.setattr(model_loading, "load_params", refuse)
    loaded = load_model(EngineArgs(model=path, dtype="bfloat16", load_format="dummy"), progress=False)
    assert loaded.config.num_layers == 30 and loaded.config.vocab_size == 49152
    assert loaded.params.embed.shape == (49152, 576) and loaded.params.embed.dtype == jnp.bfloat16
    assert loaded.tokenizer.encode(" Paris") == [7042]  # the GGUF's own tokenizer


def test_flag_and_validation():
    ns = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(["--load-format", "dummy"])
    assert EngineArgs.from_cli_args(ns).load_format == "dummy"
    assert EngineArgs().load_format == "auto"
    with pytest.raises(ValueError, match="load_format must be one of auto, safetensors, mistral, dummy, got 'pt'"):
        EngineArgs(load_format="pt")
    with pytest.raises(ValueError, match="cannot be combined with converted_checkpoint_dir"):
        EngineArgs(load_format="dummy", converted_checkpoint_dir="/tmp/x")


def test_tp2_dummy_weights_are_made_in_their_shards(tmp_path):
    r = run_module("tests.test_load_dummy", str(tmp_path), devices=2, timeout=120)
    # Each device holds half of the 8 query heads, and the sharded tree is the one the plan declares.
    assert r["wq_devices"] == 2 and r["wq_shard_heads"] == 4
    assert r["shardings_match_plan"]
    assert r["tokens"] == 5


def _child(tmp: str) -> dict:
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.sampling_params import SamplingParams

    model = _config_only(os.path.join(tmp, "model"))
    args = EngineArgs(model=model, dtype="float32", load_format="dummy", tensor_parallel_size=2, max_num_seqs=2,
                      max_num_batched_tokens=16, max_model_len=32, kv_cache_memory_bytes=1 << 20, warmup=False,
                      compile_cache_dir=None)
    engine = LLMEngine(args, progress=False)
    params = engine.model.params
    wq = params.layers.wq if not isinstance(params.layers, tuple) else params.layers[0].wq
    plan = engine.model.plan
    want = jax.tree.leaves(plan.param_shardings())
    got = [leaf.sharding for leaf in jax.tree.leaves(load_model(args, progress=False).params)]
    engine.add_request("r", [3, 4, 5, 6], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    tokens: list[int] = []
    for _ in range(50):
        tokens = [out.outputs[0].token_ids for out in engine.step() if out.finished] or tokens
        if not engine.has_unfinished_requests():
            break
    return {
        "wq_devices": len(wq.sharding.device_set),
        "wq_shard_heads": wq.addressable_shards[0].data.shape[-2],
        "shardings_match_plan": len(got) == len(want) and all(g == w for g, w in zip(got, want, strict=True)),
        "tokens": len(tokens[0]) if tokens else 0,
    }


if __name__ == "__main__":
    print(RESULT_PREFIX + json.dumps(_child(sys.argv[1])), flush=True)
