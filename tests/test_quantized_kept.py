"""Quantized checkpoints held quantized in memory: float8 and int8 weights with a scale per tensor or per output
channel (compressed-tensors' FP8, FP8_DYNAMIC and W8A8 schemes, quant_method fp8 per tensor) are kept as stored,
each tensor's scale as every channel's, and compute the logits of the same checkpoint read dequantized; other
forms (blocks, groups, a projection left in float) are dequantized at load as before."""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("compressed_tensors")

from jaxserve.config import ModelConfig, UnsupportedModelError  # noqa: E402
from jaxserve.engine.llm_engine import LLMEngine  # noqa: E402
from jaxserve.engine.model_loading import check_quantization, load_model, params_bytes  # noqa: E402
from jaxserve.engine_args import EngineArgs  # noqa: E402
from jaxserve.loader import CheckpointError, load_params, open_checkpoint  # noqa: E402
from tests.fake_model import fake_tokenizer  # noqa: E402
from tests.modelrun import prompt_logits  # noqa: E402
from tests.test_model_families import random_prompt, rel_err  # noqa: E402
from tests.test_quantized_checkpoints import _mixtral, compressed_tensors_checkpoint, ours  # noqa: E402
from tests.test_sharding_worker import ENGINE_ARGS, PROMPTS, _generate  # noqa: E402

# compressed-tensors preset -> the form it is held in, its scales' strategy and weight overrides
CASES = {"FP8": ("fp8", "tensor", {}), "FP8_DYNAMIC": ("fp8", "channel", {}), "W8A8": ("int8", "channel", {}),
         "FP8_BLOCK": (None, "block", {"block_structure": [32, 32]}),
         "W8A16": ("int8", "channel", {"strategy": "channel", "group_size": None})}  # packed into int32


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """`checkpoint(preset)`: a tiny Llama saved by compressed-tensors under that preset (made once each), with a
    tokenizer."""
    made = {}

    def make(preset: str) -> str:
        if preset not in made:
            path = tmp_path_factory.mktemp(preset.lower())
            compressed_tensors_checkpoint(path, preset, **CASES[preset][2])
            fake_tokenizer().save_hf(str(path))
            made[preset] = str(path)
        return made[preset]

    return make


def stored(path: str) -> dict[str, np.ndarray]:
    return dict(open_checkpoint(path)._stored_tensors())


@pytest.mark.parametrize("preset", ["FP8", "FP8_DYNAMIC", "W8A8"])
def test_kept_weights_are_the_stored_bytes_and_give_the_dequantized_logits(checkpoint, preset):
    """Each projection's values are the checkpoint's bytes (transposed to our layout), its scales the stored
    ones (a tensor's repeated over the channels); the logits equal the checkpoint read dequantized in float32,
    at about a quarter of the projections' bytes."""
    form, strategy, _ = CASES[preset]
    path = checkpoint(preset)
    loaded = load_model(EngineArgs(model=path, dtype="float32", quantization=form), progress=False)
    assert loaded.config.weight_quant == form
    tensors = stored(path)
    layers = loaded.params.layers
    for layer in range(2):
        for name, ours_w in (("self_attn.q_proj", layers.wq), ("self_attn.v_proj", layers.wv),
                             ("self_attn.o_proj", layers.wo), ("mlp.down_proj", layers.w_down)):
            q = tensors[f"model.layers.{layer}.{name}.weight"]
            scale = tensors[f"model.layers.{layer}.{name}.weight_scale"].astype(np.float32)
            assert scale.size == (1 if strategy == "tensor" else q.shape[0])
            N = q.shape[0]
            flat = np.asarray(ours_w.q[layer]).reshape(-1, N)  # [K, N]: the input axes first
            assert flat.dtype == q.dtype
            np.testing.assert_array_equal(flat.view(np.uint8), q.T.view(np.uint8))
            np.testing.assert_array_equal(np.asarray(ours_w.scale[layer]).reshape(-1),
                                          np.broadcast_to(scale.reshape(-1), (N,)))
    ids = random_prompt()
    got = prompt_logits(loaded.config, loaded.params, ids)
    want = ours(path, ids)  # the checkpoint read dequantized, float32
    assert rel_err(got, want) < 1e-5
    ckpt = open_checkpoint(path)
    floats = load_params(ckpt, ckpt.config(), jnp.float32, progress=False)
    assert params_bytes(layers) < 0.35 * params_bytes(floats.layers)


@pytest.mark.parametrize("kind", ["W8A16", "gptq"])
def test_packed_and_gptq_8bit_channels_are_held_in_int8(checkpoint, tmp_path, kind):
    """compressed-tensors' 8-bit values packed into int32 words, and GPTQ's symmetric 8-bit weights with one group
    (a scale per channel, zero point 128): held in int8, the logits of the checkpoint read dequantized."""
    from tests.test_quantized_gptq_awq import quantized_checkpoint

    path = checkpoint(kind) if kind == "W8A16" else str(tmp_path)
    if kind == "gptq":
        quantized_checkpoint(tmp_path, "gptq", bits=8, sym=True, group=-1)
        fake_tokenizer().save_hf(path)
    assert any(n.endswith("weight_packed" if kind == "W8A16" else "qweight") for n in open_checkpoint(path).tensor_names())
    loaded = load_model(EngineArgs(model=path, dtype="float32"), progress=False)
    assert loaded.config.weight_quant == "int8" and loaded.params.layers.w_up.q.dtype == jnp.int8
    ids = random_prompt()
    assert rel_err(prompt_logits(loaded.config, loaded.params, ids), ours(path, ids)) < 1e-5


def test_which_checkpoints_are_held_quantized(checkpoint, tmp_path):
    """int8 by default; float8 on the CPU when named (its own method or fp8), dequantized otherwise; blocks
    dequantized; a projection the checkpoint leaves in float makes the whole model dequantized; another form
    named is refused."""
    def decide(path, method):
        ckpt = open_checkpoint(path)
        return check_quantization(method, path, ckpt.hf_config, ckpt.config())

    w8, fp8, block = checkpoint("W8A8"), checkpoint("FP8_DYNAMIC"), checkpoint("FP8_BLOCK")
    assert decide(w8, None) == decide(w8, "int8") == decide(w8, "compressed-tensors") == ("int8", None)
    assert decide(fp8, None) == (None, None)
    assert decide(fp8, "fp8") == decide(fp8, "compressed-tensors") == ("fp8", None)
    assert decide(block, None) == decide(block, "compressed-tensors") == (None, None)
    with pytest.raises(UnsupportedModelError, match="'int8' does not match .*quantized with 'compressed-tensors'"):
        decide(fp8, "int8")
    # Blocks are dequantized at load, so they may be held quantized again per channel; another method is refused.
    assert decide(block, "fp8") == ("fp8", None) and decide(block, "int8") == ("int8", None)
    with pytest.raises(UnsupportedModelError, match="'gptq' does not match .*quantized with 'compressed-tensors'"):
        decide(block, "gptq")
    config = json.loads(open(f"{w8}/config.json").read())
    config["quantization_config"]["ignore"] = ["lm_head", "model.layers.1.mlp.down_proj"]
    cfg = open_checkpoint(w8).config()
    assert check_quantization(None, "m", config, cfg) == (None, None)
    # Only a KV cache scheme: no weight is quantized, so the weights may be quantized at load.
    kv_only = {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {},
                                       "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}}}
    assert check_quantization("int8", "m", kv_only, cfg) == (None, "int8")
    assert check_quantization("compressed-tensors", "m", kv_only, cfg) == (None, None)
    # A MoE model's int8 experts alone are held (experts_int8); its attention, in 4-bit groups, dequantized.
    moe = ModelConfig("mixtral", 96, 32, 48, 2, 4, 2, 8, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16)
    groups = {"experts": {"targets": ["re:.*experts.*"], "format": "int-quantized",
                          "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}},
              "attention": {"targets": ["re:.*self_attn.*"], "format": "pack-quantized",
                            "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 16}}}
    experts = {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": groups}}
    assert check_quantization(None, "m", experts, moe) == ("experts_int8", None)
    groups["experts"]["weights"]["strategy"] = "group"
    groups["experts"]["weights"]["group_size"] = 16
    assert check_quantization(None, "m", experts, moe) == (None, None)


def test_engine_on_kept_weights_serves_the_dequantized_tokens(checkpoint):
    """The engine on float8 weights held so (scanned decode loop, prefix cache) gives the greedy tokens of an
    engine on the same checkpoint dequantized; no compile after warmup."""
    path = checkpoint("FP8_DYNAMIC")
    args = EngineArgs(model=path, dtype="float32", **ENGINE_ARGS)
    kept = LLMEngine(args.replace(quantization="fp8", strict_compile=True), progress=False)
    assert kept.model.config.weight_quant == "fp8"
    ref = LLMEngine(args, progress=False)
    assert ref.model.config.weight_quant is None
    got = _generate(kept, PROMPTS)
    assert got == _generate(ref, PROMPTS)
    assert _generate(kept, PROMPTS) == got
    assert kept.stats().compilations_after_warmup == 0


@pytest.mark.parametrize("form", ["fp8", "experts_int8"])
def test_mixtral_experts_are_held_and_a_missing_scale_is_named(tmp_path, form):
    """A Mixtral whose router is left alone. fp8: quant_method fp8 without blocks (one `weight_scale` per tensor),
    every projection and expert held in float8. experts_int8: compressed-tensors int8 experts with a scale per
    channel, the attention left in float: the experts held in int8, the attention in float32. Either way the
    logits of the checkpoint read dequantized; a weight whose scale never comes is named."""
    from safetensors.torch import load_file, save_file

    model = _mixtral()
    model.save_pretrained(tmp_path / "plain")
    tensors = {}
    quantized = (".w1.weight", ".w2.weight", ".w3.weight") + (("_proj.weight",) if form == "fp8" else ())
    for name, p in load_file(tmp_path / "plain" / "model.safetensors").items():
        if p.ndim == 2 and name.endswith(quantized):
            if form == "fp8":
                scale = p.abs().amax().reshape(1) / 448.0
                q = (p / scale).to(torch.float8_e4m3fn)
            else:
                scale = p.abs().amax(1, keepdim=True) / 127.0
                q = torch.round(p / scale).to(torch.int8)
            tensors[name], tensors[name + "_scale"] = q, scale.float()
        else:
            tensors[name] = p.contiguous()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    quant = {"quant_method": "fp8", "activation_scheme": "dynamic", "modules_to_not_convert": ["lm_head", "gate"]}
    if form == "experts_int8":
        quant = {"quant_method": "compressed-tensors", "config_groups": {"experts": {
            "targets": ["re:.*experts.*"], "format": "int-quantized",
            "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}}
    config = json.loads((tmp_path / "plain" / "config.json").read_text()) | {"quantization_config": quant}
    (tmp_path / "config.json").write_text(json.dumps(config))
    fake_tokenizer().save_hf(str(tmp_path))
    loaded = load_model(EngineArgs(model=str(tmp_path), dtype="float32", quantization=form), progress=False)
    layers = loaded.params.layers
    assert loaded.config.weight_quant == form and layers.router.dtype == jnp.float32
    assert layers.we_gate.q.dtype == (jnp.float8_e4m3fn if form == "fp8" else jnp.int8)
    assert (layers.wq.q.dtype == jnp.float8_e4m3fn) if form == "fp8" else (layers.wq.dtype == jnp.float32)
    want = tensors["model.layers.1.block_sparse_moe.experts.2.w2.weight_scale"].reshape(-1).numpy()
    np.testing.assert_array_equal(np.asarray(layers.we_down.scale[1, 2]).reshape(-1),
                                  np.broadcast_to(want, (layers.we_down.q.shape[-1],)))
    ids = random_prompt()
    assert rel_err(prompt_logits(loaded.config, loaded.params, ids), ours(tmp_path, ids)) < 1e-5
    del tensors["model.layers.0.block_sparse_moe.experts.1.w3.weight_scale"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=re.escape(
            "quantized weight model.layers.0.block_sparse_moe.experts.1.w3 is missing "
            "model.layers.0.block_sparse_moe.experts.1.w3.weight_scale")):
        load_model(EngineArgs(model=str(tmp_path), quantization=form), progress=False)


def test_a_converted_copy_of_kept_weights_restores_them(checkpoint, tmp_path, caplog):
    """`--converted-checkpoint-dir`: int8 weights held as stored are saved so (the form recorded) and restored
    bit for bit on the next start."""
    import jax

    from sharding.checkpoint import saved_info

    args = EngineArgs(model=checkpoint("W8A8"), dtype="float32", converted_checkpoint_dir=str(tmp_path / "conv"))
    first = load_model(args, progress=False)
    assert saved_info(tmp_path / "conv").config.weight_quant == "int8"
    with caplog.at_level("INFO", logger="jaxserve.engine.model_loading"):
        again = load_model(args, progress=False)
    assert "restored converted weights" in caplog.text
    assert again.config.weight_quant == "int8" and again.params.layers.w_up.q.dtype == jnp.int8
    for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(again.params), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_convert_writes_kept_weights_dequantized(checkpoint, tmp_path):
    """`jaxserve convert --to-hf` of a checkpoint held in int8 writes its weights dequantized (float32, no
    quantization config): they give the logits of the checkpoint read dequantized."""
    from jaxserve.cli import main

    path = checkpoint("W8A8")
    assert main(["convert", path, "--to-hf", str(tmp_path / "out")]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config
    ids = random_prompt()
    assert rel_err(ours(tmp_path / "out", ids), ours(path, ids)) < 1e-6
