"""Per-layer float8 KV cache scales: a float8 page holds K / k_scale and V / v_scale.

Checked here: the scaled attention is the attention of the true keys and values (exactly, for scales
that are powers of two); a model whose keys and values reach past float8's range saturates at scale 1
and does not with calculated scales (`--calculate-kv-scales`); checkpoint scales (compressed-tensors'
`self_attn.k_scale` / `v_scale`) load in float32 and round-trip through `jaxserve convert`; bad
scales and quantized weights are refused by name; an engine on calculated scales."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxserve.config import ModelConfig, UnsupportedModelError
from jaxserve.engine.kv_scales import HEADROOM, measure_kv_amax, scales_from_amax, with_kv_scales
from jaxserve.engine.kv_transfer import KVLayout
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.model_loading import LoadedModel
from jaxserve.engine_args import EngineArgs
from jaxserve.loader import CheckpointError, load_params, open_checkpoint
from jaxserve.loader.export import export_hf
from jaxserve.sampling_params import SamplingParams
from tests.fake_model import fake_tokenizer
from tests.modelrun import prompt_logits
from tests.test_engine_pallas import CFG, numpy_params
from tests.test_kv_cache_dtype import ARGS
from tests.test_loader_errors import CFG as HF_CFG
from tests.test_loader_errors import hf_tensors, write_hf_dir

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
C = 2000.0  # K and V scaled up by C, q and the output projection down: the same model, |K|, |V| ~ 1e4


def _loud_params(seed: int = 3):
    """Random weights whose keys and values reach ~1e4, far past float8_e4m3fn's 448, while the model's
    function is that of the unscaled weights (q and o divide what k and v multiply)."""
    p = numpy_params(CFG, seed=seed, scale=0.3)
    lp = p.layers
    return dataclasses.replace(p, layers=dataclasses.replace(lp, wk=lp.wk * C, wq=lp.wq / C, wv=lp.wv * C,
                                                             wo=lp.wo / C))


def _loaded(params, cfg=CFG) -> LoadedModel:
    return LoadedModel("tiny", "tiny-llama", cfg, params, fake_tokenizer(), jnp.float32, 0.0)


def _scaled(params, k_scale, v_scale):
    layers = dataclasses.replace(params.layers, k_scale=jnp.asarray(k_scale, jnp.float32),
                                 v_scale=jnp.asarray(v_scale, jnp.float32))
    return dataclasses.replace(params, layers=layers)


def _kl(ref, got) -> float:
    ref, got = jax.nn.log_softmax(ref), jax.nn.log_softmax(got)
    return float(np.mean(np.sum(np.exp(ref) * (ref - got), axis=-1)))


IDS = [int(x) for x in np.random.default_rng(0).integers(2, 60, 37)]


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_power_of_two_scales_change_only_the_subnormals(dtype):
    """Dividing by 2^k before the cast and multiplying q and the output back is exact in float8's normal
    range, so the logits move far less than float8 moves them from float32 (only values that cross the
    subnormal range round differently); a wrong fold (q divided, or the output left unscaled) moves them
    by far more."""
    params = numpy_params(CFG, seed=3, scale=0.3)
    run = functools.partial(prompt_logits, CFG, ids=IDS, page_size=8, num_pages=32)
    exact, plain = run(params), run(params, dtype=dtype)
    scaled = run(_scaled(params, [0.25, 0.5], [0.5, 0.125]), dtype=dtype)
    rounding = np.max(np.abs(plain - exact))
    assert rounding > 1e-3  # float8 did round
    assert np.max(np.abs(scaled - plain)) < 0.1 * rounding, (np.max(np.abs(scaled - plain)), rounding)


def test_scales_are_ignored_by_a_cache_that_is_not_float8():
    params = numpy_params(CFG, seed=3, scale=0.3)
    for dtype in (jnp.float32, jnp.bfloat16):
        np.testing.assert_array_equal(
            prompt_logits(CFG, _scaled(params, [3.0, 5.0], [7.0, 0.1]), IDS, page_size=8, num_pages=32, dtype=dtype),
            prompt_logits(CFG, params, IDS, page_size=8, num_pages=32, dtype=dtype))


def test_calculated_scales_keep_loud_keys_and_values_in_range():
    """Keys and values of ~1e4 saturate a float8 cache at scale 1 (the model's outputs are lost); with
    the calculated scales the float8 cache is as close to float32 as for a quiet model."""
    params = _loud_params()
    loaded = _loaded(params)
    k_max, v_max, tokens = measure_kv_amax(loaded, page_size=8)
    assert tokens > 100 and np.all(k_max > 5e3) and np.all(v_max > 5e3), (k_max, v_max)
    k_scale, v_scale = scales_from_amax(k_max, E4M3), scales_from_amax(v_max, E4M3)
    np.testing.assert_allclose(k_scale, k_max * HEADROOM / 448.0, rtol=1e-6)
    ref = prompt_logits(CFG, params, IDS, page_size=8, num_pages=32)
    saturated = _kl(ref, prompt_logits(CFG, params, IDS, page_size=8, num_pages=32, dtype=E4M3))
    scaled = with_kv_scales(loaded, k_scale, v_scale)
    assert scaled.config.kv_cache_scales and scaled.params.layers.k_scale.dtype == jnp.float32
    kl = _kl(ref, prompt_logits(scaled.config, scaled.params, IDS, page_size=8, num_pages=32, dtype=E4M3))
    quiet = numpy_params(CFG, seed=3, scale=0.3)
    quiet_kl = _kl(prompt_logits(CFG, quiet, IDS, page_size=8, num_pages=32),
                   prompt_logits(CFG, quiet, IDS, page_size=8, num_pages=32, dtype=E4M3))
    assert saturated > 0.1 and kl < 3 * quiet_kl + 1e-3, (saturated, kl, quiet_kl)


def test_scales_from_amax_keep_one_for_a_silent_layer():
    np.testing.assert_allclose(scales_from_amax(np.array([0.0, 57344.0 / HEADROOM]), E5M2), [1.0, 1.0])


# ----------------------------------------------------------------------------------------------------------
# Checkpoint scales

SCALED_CFG = dataclasses.replace(HF_CFG, kv_cache_scales=True)


def _scaled_tensors(shape=()) -> dict[str, np.ndarray]:
    tensors = hf_tensors(SCALED_CFG)
    for i in range(SCALED_CFG.num_layers):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = np.full(shape, 0.1 + i, np.float32)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = np.full(shape, 0.3 + i, np.float32)
    return tensors


@pytest.mark.parametrize("shape", [(), (1,)])
def test_checkpoint_scales_load_in_float32(tmp_path, shape):
    path = write_hf_dir(tmp_path, [_scaled_tensors(shape)], SCALED_CFG.to_hf())
    ckpt = open_checkpoint(path)
    assert ckpt.config().kv_cache_scales
    params = load_params(ckpt, ckpt.config(), jnp.bfloat16, progress=False)
    assert params.layers.k_scale.dtype == jnp.float32 and params.layers.wq.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(params.layers.k_scale), [0.1, 1.1], rtol=1e-7)
    np.testing.assert_allclose(np.asarray(params.layers.v_scale), [0.3, 1.3], rtol=1e-7)


def test_checkpoint_scales_round_trip_through_convert(tmp_path):
    params = _scaled(numpy_params(CFG, seed=1, scale=0.3), [0.37, 1.9], [0.011, 2.5])
    cfg = dataclasses.replace(CFG, kv_cache_scales=True)
    export_hf(str(tmp_path), cfg, params, fake_tokenizer(), dtype="bfloat16")
    with open(os.path.join(tmp_path, "config.json")) as f:
        assert json.load(f)["quantization_config"]["kv_cache_scheme"]["type"] == "float"
    stored = load_file(os.path.join(tmp_path, "model.safetensors"))
    assert stored["model.layers.1.self_attn.k_scale"].dtype == np.float32
    ckpt = open_checkpoint(str(tmp_path))
    back = load_params(ckpt, ckpt.config(), jnp.float32, progress=False)
    np.testing.assert_array_equal(np.asarray(back.layers.k_scale), np.float32([0.37, 1.9]))
    np.testing.assert_array_equal(np.asarray(back.layers.v_scale), np.float32([0.011, 2.5]))


def test_bad_checkpoint_scales_are_named(tmp_path):
    tensors = _scaled_tensors()
    tensors["model.layers.1.self_attn.v_scale"] = np.zeros((), np.float32)
    with pytest.raises(CheckpointError, match=re.escape(
            "tensor 'model.layers.1.self_attn.v_scale' is 0.0, a KV cache scale must be positive")):
        _load(write_hf_dir(tmp_path / "zero", [tensors], SCALED_CFG.to_hf()))
    tensors = _scaled_tensors()
    del tensors["model.layers.0.self_attn.k_scale"]
    with pytest.raises(CheckpointError, match=re.escape("missing 1 tensor(s): model.layers.0.self_attn.k_scale")):
        _load(write_hf_dir(tmp_path / "missing", [tensors], SCALED_CFG.to_hf()))
    # Scales without a kv_cache_scheme in the config are tensors of no parameter.
    with pytest.raises(CheckpointError, match="unknown tensor 'model.layers.0.self_attn.k_scale'"):
        _load(write_hf_dir(tmp_path / "undeclared", [_scaled_tensors()], HF_CFG.to_hf()))


def test_unsupported_quantization_configs_are_refused_by_name():
    """(Quantized weights: tests/test_quantized_checkpoints.py.)"""
    config = HF_CFG.to_hf() | {"quantization_config": {"quant_method": "compressed-tensors",
                                                        "config_groups": {"group_0": {}}}}
    with pytest.raises(UnsupportedModelError, match="config group 'group_0' quantizes no weights"):
        ModelConfig.from_hf(config)
    config["quantization_config"] = {"quant_method": "compressed-tensors", "kv_cache_scheme": {
        "num_bits": 8, "type": "float", "strategy": "channel"}}
    with pytest.raises(UnsupportedModelError, match="kv_cache_scheme .*'channel'.* is not supported"):
        ModelConfig.from_hf(config)


def _load(path):
    ckpt = open_checkpoint(path)
    return load_params(ckpt, ckpt.config(), jnp.float32, progress=False)


# ----------------------------------------------------------------------------------------------------------
# The engine

def test_flag_and_its_errors():
    ns = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(
        ["--kv-cache-dtype", "fp8", "--calculate-kv-scales"])
    assert EngineArgs.from_cli_args(ns).calculate_kv_scales
    with pytest.raises(ValueError, match="calculate_kv_scales needs a float8 KV cache .* got kv_cache_dtype 'auto'"):
        EngineArgs(calculate_kv_scales=True)


def _greedy(engine: LLMEngine, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
    return out


def test_engine_with_calculated_scales():
    """The engine measures the scales at start-up and serves on them: its first greedy tokens over loud
    keys and values are float32's, where scale 1 loses them; its integrity holds."""
    params = _loud_params()
    prompts = {f"r{i}": [int(x) for x in np.random.default_rng(i).integers(2, 60, 20 + 7 * i)] for i in range(4)}
    ref = _greedy(LLMEngine(ARGS.replace(kv_cache_dtype="auto"), loaded=_loaded(params),
                                        progress=False), prompts)
    engine = LLMEngine(ARGS.replace(calculate_kv_scales=True), loaded=_loaded(params), progress=False)
    assert engine.model.config.kv_cache_scales and engine.stats().calculate_kv_scales  # /metrics' label
    scales = [float(lp.k_scale) for lp in engine.model.params.layers]
    assert all(s > 10 for s in scales), scales  # |K| ~ 1e4 over a quarter of 448
    got = _greedy(engine, prompts)
    engine.scheduler.check_integrity()
    plain = LLMEngine(ARGS, loaded=_loaded(params), progress=False)
    saturated = _greedy(plain, prompts)
    # A P/D receiver takes float8 pages only from a sender on the same scales (`KVLayout.scales`).
    digest = KVLayout.of_engine(engine).scales
    assert len(digest) == 16 and KVLayout.of_engine(plain).scales == ""
    # The same scales measured on a model already split per layer (an engine's own, fused on one device).
    assert isinstance(plain.model.params.layers, tuple)
    again = LLMEngine(ARGS.replace(calculate_kv_scales=True), loaded=plain.model, progress=False)
    np.testing.assert_allclose([float(lp.k_scale) for lp in again.model.params.layers], scales, rtol=1e-5)
    assert len(KVLayout.of_engine(again).scales) == 16
    assert all(got[r][0] == ref[r][0] for r in prompts), (got, ref)
    assert sum(got[r][:2] == ref[r][:2] for r in prompts) > sum(saturated[r][:2] == ref[r][:2] for r in prompts)
