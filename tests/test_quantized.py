"""Weights quantized at load and kept so (`--quantization fp8 | int8 | experts_int8`): the stored form, the forward
pass against the float model on the very dequantized weights, loading and the engine end to end, the refusals."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import ModelConfig, UnsupportedModelError
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.model_loading import check_quantization, load_model, params_bytes
from jaxserve.engine_args import EngineArgs
from jaxserve.loader import checkpoint_tokenizer, open_checkpoint
from jaxserve.loader.export import export_hf
from jaxserve.models.params import declare_params, init_params, param_paths
from jaxserve.models.quantized import METHODS, QuantizedWeight, dequantize, quantize, quantize_layers
from jaxserve.models.unstack import unstack_layers
from tests.fake_model import fake_tokenizer
from tests.modelrun import prompt_logits
from tests.test_sharding_worker import ENGINE_ARGS, PROMPTS, _generate

DENSE = ModelConfig("llama", 96, 32, 48, 3, 4, 2, 8, attention_bias=True, mlp_bias=True)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
MIXTRAL = ModelConfig("mixtral", 96, 32, 48, 2, 4, 2, 8, **MOE)
QWEN2_MOE = ModelConfig("qwen2_moe", 96, 32, 48, 2, 4, 2, 8, **MOE, shared_expert_intermediate_size=24,
                        attention_bias=True)
IDS = [5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 12, 50, 4, 90, 27, 66, 8, 39, 77]


def quantized(cfg: ModelConfig, method: str, seed: int = 0):
    """(float params, the config and params with `method`'s weights quantized)."""
    params = init_params(cfg, jax.random.key(seed), scale=0.1)
    qcfg = dataclasses.replace(cfg, weight_quant=method)
    layers = quantize_layers(params.layers, declare_params(qcfg).layers)
    return params, qcfg, dataclasses.replace(params, layers=layers)


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn])
def test_quantize_stores_each_output_channel_within_its_step(dtype):
    """One scale per output channel (the input axis reduced); each channel's largest weight exact; int8 within
    half a step of every weight, float8 within its 3-bit mantissa's relative step; a zero channel stays zero."""
    w = np.random.default_rng(0).normal(0, 0.3, (64, 5, 8)).astype(np.float32)
    w[:, 2, 3] = 0.0
    w[7, 1, 1] = 40.0  # an outlier only scales its own channel
    qw = quantize(jnp.asarray(w), dtype, (0,))
    assert qw.q.dtype == dtype and qw.scale.shape == (1, 5, 8) and qw.scale.dtype == jnp.float32
    back = np.asarray(dequantize(qw, jnp.float32))
    assert np.all(back[:, 2, 3] == 0) and np.all(np.isfinite(back))
    top = np.abs(w).max(axis=0)
    np.testing.assert_allclose(np.abs(back).max(axis=0), top, rtol=1e-6)
    err = np.abs(back - w)
    if dtype == jnp.int8:
        assert np.all(err <= np.asarray(qw.scale)[0] / 2 + 1e-6)
    else:
        normal = np.abs(w) >= 2.0 ** -6 * np.asarray(qw.scale)[0]
        assert np.all(err[normal] <= np.abs(w[normal]) * 2.0 ** -4 + 1e-7)
    other = np.ones(8, bool)
    other[1] = False
    assert float(qw.scale[0, 1, 1]) == pytest.approx(40.0 / float(jnp.finfo(dtype).max if dtype != jnp.int8 else 127))
    assert float(qw.scale[0, 1, other].max()) < 0.02  # the other channels keep their own fine steps


@pytest.mark.parametrize("cfg,method", [(DENSE, "int8"), (QWEN2_MOE, "fp8"), (MIXTRAL, "experts_int8")],
                         ids=["llama-int8", "qwen2_moe-fp8", "mixtral-experts_int8"])
def test_quantized_forward_is_the_float_model_on_its_dequantized_weights(cfg, method):
    """Logits of the quantized model = the float model's on q * scale (the forward dequantizes exactly where it
    reads), stacked and as fused per-layer matrices; the method stores what it names and nothing else."""
    params, qcfg, qparams = quantized(cfg, method)
    flat = param_paths(qparams)
    want = METHODS[method]
    for path, value in flat.items():
        name = path.removeprefix("layers.")
        if name in want.fields:
            assert isinstance(value, QuantizedWeight) and value.q.dtype == want.dtype, path
        else:
            assert not isinstance(value, QuantizedWeight) and value.dtype == jnp.float32, path
    got = prompt_logits(qcfg, qparams, IDS)
    same = prompt_logits(cfg, dataclasses.replace(qparams, layers=dequantize(qparams.layers, jnp.float32)), IDS)
    np.testing.assert_allclose(got, same, atol=2e-6, rtol=1e-5)
    ref = prompt_logits(cfg, params, IDS)
    tol = 0.03 if want.dtype == jnp.int8 else 0.12  # float8_e4m3fn keeps 3 mantissa bits
    assert 0 < np.abs(got - ref).max() < tol * np.abs(ref).max()  # quantized, and close to the float model
    if not cfg.num_experts:
        fused = unstack_layers(qparams, fuse=True)
        assert isinstance(fused.layers[0].wqkv, QuantizedWeight) and fused.layers[0].wqkv.scale.shape[1] == 1
        np.testing.assert_allclose(prompt_logits(qcfg, fused, IDS), got, atol=2e-6, rtol=1e-5)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    """An HF checkpoint of `DENSE` (random weights)."""
    path = str(tmp_path_factory.mktemp("quant"))
    export_hf(path, DENSE, init_params(DENSE, jax.random.key(3), scale=0.1), fake_tokenizer())
    return path


def test_load_quantizes_and_the_engine_serves_it(tiny_dir):
    """`--quantization int8` on an unquantized checkpoint (fp8 differs only in the stored dtype): projections
    stored at a quarter of float32's bytes, and the engine's greedy tokens (scanned layers, the CPU's choice for
    quantized weights; decode loop; prefix cache) equal an engine's on the float model holding the dequantized
    weights (unrolled, fused layers)."""
    path, method = tiny_dir, "int8"
    args = EngineArgs(model=path, dtype="float32", **ENGINE_ARGS)
    loaded = load_model(args.replace(quantization=method), progress=False)
    assert loaded.config.weight_quant == method
    wq = loaded.params.layers.wq
    assert wq.q.dtype == METHODS[method].dtype and wq.q.shape == (3, 32, 4, 8) and wq.scale.shape == (3, 1, 4, 8)
    floats = load_model(args, progress=False)
    assert params_bytes(loaded.params.layers) < 0.35 * params_bytes(floats.params.layers)  # norms, biases in float
    engine = LLMEngine(args.replace(quantization=method, strict_compile=True), loaded=loaded, progress=False)
    dequantized = dataclasses.replace(loaded, config=dataclasses.replace(loaded.config, weight_quant=None),
                                      params=dataclasses.replace(loaded.params, layers=dequantize(
                                          loaded.params.layers, jnp.float32)))
    ref = LLMEngine(args, loaded=dequantized, progress=False)
    got = _generate(engine, PROMPTS)
    assert got == _generate(ref, PROMPTS)
    assert _generate(engine, PROMPTS) == got  # again, from the prefix cache
    assert engine.stats().compilations_after_warmup == 0


def test_dummy_weights_quantize_too(tiny_dir):
    loaded = load_model(EngineArgs(model=tiny_dir, load_format="dummy", quantization="fp8"), progress=False)
    assert loaded.params.layers.w_down.q.dtype == jnp.float8_e4m3fn


def test_quantization_refusals(tiny_dir):
    """A method not quantizing at load nor the checkpoint's own, experts_int8 on a dense model, a quantized
    checkpoint asked for another method: each refused by name."""
    assert check_quantization(None, "m", {}) == (None, None)
    assert check_quantization("int8", "m", {}) == (None, "int8")
    assert check_quantization("gptq_marlin", "m", {"quantization_config": {"quant_method": "gptq"}}) == (None, None)
    gptq = {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}}
    assert check_quantization("int8", "m", gptq) == ("int8", None)  # dequantized at load, then held as int8
    with pytest.raises(UnsupportedModelError, match=r"'awq' does not match m: its weights are quantized with 'gptq'"):
        check_quantization("awq", "m", gptq)
    with pytest.raises(UnsupportedModelError, match=r"'nf4' does not match m: its weights are not quantized.*fp8, "
                                                    r"int8, experts_int8"):
        check_quantization("nf4", "m", {})
    with pytest.raises(UnsupportedModelError, match="experts_int8.*this model has none"):
        load_model(EngineArgs(model=tiny_dir, quantization="experts_int8"), progress=False)
    with pytest.raises(UnsupportedModelError, match="unknown weight quantization 'int4'"):
        dataclasses.replace(DENSE, weight_quant="int4")
    with pytest.raises(ValueError, match="random weights are drawn in float"):
        init_params(dataclasses.replace(DENSE, weight_quant="int8"), jax.random.key(0))


def test_a_quantized_gguf_held_quantized_is_quantized_tensor_by_tensor(smollm_path, smollm_f32, monkeypatch):
    """The bundled GGUF's Q4_1 blocks are dequantized at load (`--quantization gguf` names them); with int8 each
    tensor is quantized on the host as it is read: the model equals the float one quantized once loaded."""
    cfg, params = smollm_f32
    assert open_checkpoint(smollm_path).quantized
    assert check_quantization(None, smollm_path, {}, cfg, gguf_quantized=True) == (None, None)
    assert check_quantization("gguf", smollm_path, {}, cfg, gguf_quantized=True) == (None, None)
    assert check_quantization("int8", smollm_path, {}, cfg, gguf_quantized=True) == ("int8", None)
    with pytest.raises(UnsupportedModelError, match="'awq' does not match .*its weights are quantized with 'gguf'"):
        check_quantization("awq", smollm_path, {}, cfg, gguf_quantized=True)
    from jaxserve.engine import model_loading

    def whole(*_args):
        raise AssertionError("the float model was loaded whole, then quantized")

    monkeypatch.setattr(model_loading, "quantize_model", whole)
    loaded = load_model(EngineArgs(model=smollm_path, quantization="int8", dtype="float32"), progress=False)
    monkeypatch.undo()
    assert loaded.config.weight_quant == "int8" and loaded.params.layers.wq.q.dtype == jnp.int8
    # (the session's float params quantized without consuming them)
    after = dataclasses.replace(params, layers=quantize_layers(params.layers, declare_params(loaded.config).layers))
    ids = list(range(5, 37))
    np.testing.assert_allclose(prompt_logits(loaded.config, loaded.params, ids),
                               prompt_logits(loaded.config, after, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_bundled_model_quantized_keeps_its_predictions(smollm_path, smollm_f32, method):
    """SmolLM2 with every projection quantized: its next-token choice over a passage agrees with the float
    model's at >= 90% of positions, its next-token distributions close to the float ones (mean KL), its layers'
    weights at a quarter of their float32 bytes."""
    cfg, params = smollm_f32
    qcfg = dataclasses.replace(cfg, weight_quant=method)
    qparams = dataclasses.replace(params, layers=quantize_layers(params.layers, declare_params(qcfg).layers))
    tokenizer = checkpoint_tokenizer(smollm_path, open_checkpoint(smollm_path))
    ids = tokenizer.encode("The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is "
                           "Madrid. Water boils at 100 degrees Celsius and freezes at 0 degrees.")
    ref = prompt_logits(cfg, params, ids)
    got = prompt_logits(qcfg, qparams, ids)
    agree = np.mean(got.argmax(-1) == ref.argmax(-1))
    assert agree >= 0.9, agree  # measured: 35 of 37 positions, either method
    log_ref, log_got = jax.nn.log_softmax(ref), jax.nn.log_softmax(got)
    kl = float(jnp.mean(jnp.sum(jnp.exp(log_ref) * (log_ref - log_got), axis=-1)))
    assert kl < (0.01 if method == "int8" else 0.05), kl  # measured: 0.0041 (int8), 0.021 (fp8)
    assert params_bytes(qparams.layers) < 0.26 * params_bytes(params.layers)


def test_sleep_and_weight_updates_keep_the_weights_quantized(tiny_dir, tmp_path):
    """A quantized engine asleep (weights in host memory) wakes to the same tokens; new float weights, from a
    checkpoint or as tensors in memory, are quantized as at load and serve as an engine started on them."""
    from safetensors.numpy import load_file

    path = tiny_dir
    other = str(tmp_path / "other")
    export_hf(other, DENSE, init_params(DENSE, jax.random.key(4), scale=0.1), fake_tokenizer())
    args = EngineArgs(model=path, dtype="float32", quantization="int8", enable_sleep_mode=True, **ENGINE_ARGS)
    engine = LLMEngine(args, progress=False)
    first = _generate(engine, PROMPTS)
    engine.memory.sleep(1)
    engine.memory.wake_up()
    assert _generate(engine, PROMPTS) == first
    want = _generate(LLMEngine(args.replace(model=other), progress=False), PROMPTS)
    assert want != first
    engine.memory.load_weights(load_file(os.path.join(other, "model.safetensors")))
    assert _generate(engine, PROMPTS) == want
    assert engine.runner.params.layers.wq.q.dtype == jnp.int8  # stacked (scanned on the CPU), quantized
    engine.memory.load_weights(path)
    assert _generate(engine, PROMPTS) == first


def test_lora_adapters_over_quantized_weights(tiny_dir, tmp_path):
    """A LoRA adapter served over int8 weights gives the tokens of the adapter over the dequantized float model
    (the adapter's deltas are added to the quantized projections' outputs), and changes the base's tokens."""
    from tests.lora_tp_worker import tiny_adapter

    tiny_adapter(DENSE, str(tmp_path / "a"), seed=1)
    base = EngineArgs(model=tiny_dir, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8,
                      lora_modules=(("a", str(tmp_path / "a")),), **ENGINE_ARGS)
    engine = LLMEngine(base.replace(quantization="int8"), progress=False)
    loaded = load_model(EngineArgs(model=tiny_dir, dtype="float32", quantization="int8"), progress=False)
    dequantized = dataclasses.replace(loaded, config=dataclasses.replace(loaded.config, weight_quant=None),
                                      params=dataclasses.replace(loaded.params, layers=dequantize(
                                          loaded.params.layers, jnp.float32)))
    got = _generate(engine, PROMPTS, lora="a")
    assert got == _generate(LLMEngine(base, loaded=dequantized, progress=False), PROMPTS, lora="a")
    assert got != _generate(engine, PROMPTS)
