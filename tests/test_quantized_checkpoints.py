"""Quantized HF checkpoints (FP8, compressed-tensors) read as their own libraries read them.

Tiny random Llamas are quantized and saved by compressed-tensors itself (llm-compressor's path: a scheme applied,
scales from each weight's range, the model compressed in its format), or, for transformers' fine-grained FP8 form,
written block by block and read back by transformers. The reference is each library's own dequantization (the
compressed model decompressed by compressed-tensors; transformers' FP8 loader, which dequantizes on the CPU); our
logits over a prompt must equal the reference model's.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
ct = pytest.importorskip("compressed_tensors")

import jax.numpy as jnp  # noqa: E402
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationConfig,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

from jaxserve.config import ModelConfig, UnsupportedModelError  # noqa: E402
from jaxserve.loader import CheckpointError, load_params, open_checkpoint  # noqa: E402
from jaxserve.quantization import unpack_int32  # noqa: E402
from tests.modelrun import prompt_logits  # noqa: E402
from tests.test_model_families import TINY, hf_logits, random_prompt, rel_err  # noqa: E402

LLAMA = dict(TINY, intermediate_size=128)  # every linear's dims divisible by the groups and blocks of 32


def tiny_llama(seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**LLAMA),
                                                          attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return model.eval()


def _weight_range(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max of each scale's share of the weight (llm-compressor's min-max observer)."""
    N, K = w.shape
    if args.strategy == "tensor":
        return w.amin().reshape(1), w.amax().reshape(1)
    if args.strategy == "channel":
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    if args.strategy == "group":
        g = w.reshape(N, K // args.group_size, args.group_size)
        return g.amin(-1), g.amax(-1)
    bn, bk = args.block_structure
    b = w.reshape(N // bn, bn, K // bk, bk)
    return b.amin((1, 3)), b.amax((1, 3))


def compressed_tensors_checkpoint(path, preset: str, **weight_args):
    """A tiny Llama quantized with compressed-tensors' `preset` scheme (its weights' arguments overridden by
    `weight_args`; the LM head left alone) and saved compressed; returns the float model of the weights
    compressed-tensors decompresses from it."""
    model = tiny_llama()
    scheme = preset_name_to_scheme(preset, ["Linear"])
    scheme.weights = scheme.weights.model_copy(update=weight_args)
    if scheme.input_activations is not None and scheme.input_activations.strategy == "group":
        scheme.input_activations = scheme.input_activations.model_copy(update={"group_size": 32})  # as the blocks
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for _, m in model.named_modules():
        s = getattr(m, "quantization_scheme", None)
        if s is None:
            continue
        scale, zp = calculate_qparams(*_weight_range(m.weight.data, s.weights), s.weights)
        m.weight_scale.data = scale.reshape(m.weight_scale.shape).to(m.weight_scale.dtype)
        if hasattr(m, "weight_zero_point"):
            m.weight_zero_point.data = zp.reshape(m.weight_zero_point.shape).to(m.weight_zero_point.dtype)
        if hasattr(m, "input_scale"):  # static activation scales: dropped by the loader
            m.input_scale.data.fill_(0.5)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(path)
    compressor.decompress_model(model)
    reference = tiny_llama()
    missing, _ = reference.load_state_dict({k: v for k, v in model.state_dict().items()
                                            if k in reference.state_dict()}, strict=False)
    assert not missing
    return reference.eval()


def ours(path, ids):
    ckpt = open_checkpoint(str(path))
    cfg = ckpt.config()
    return prompt_logits(cfg, load_params(ckpt, cfg, jnp.float32, progress=False), ids)


CASES = {  # preset, weight overrides, the format and tensors compressed-tensors writes
    "W4A16": ("W4A16", {"group_size": 32}, "pack-quantized", "weight_packed"),
    "W4A16_ASYM": ("W4A16_ASYM", {"group_size": 32}, "pack-quantized", "weight_zero_point"),
    "W3A16_channel": ("W4A16", {"num_bits": 3, "strategy": "channel", "group_size": None}, "pack-quantized",
                      "weight_packed"),
    "W8A16": ("W8A16", {"group_size": 32}, "pack-quantized", "weight_packed"),
    "W8A8": ("W8A8", {}, "int-quantized", "weight_scale"),
    "FP8": ("FP8", {}, "float-quantized", "input_scale"),
    "FP8_DYNAMIC": ("FP8_DYNAMIC", {}, "float-quantized", "weight_scale"),
    "FP8_BLOCK": ("FP8_BLOCK", {"block_structure": [32, 32]}, "float-quantized", "weight_scale"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_compressed_tensors_checkpoints_read_as_compressed_tensors_reads_them(case, tmp_path):
    preset, overrides, fmt, tensor = CASES[case]
    reference = compressed_tensors_checkpoint(tmp_path, preset, **overrides)
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert config["format"] == fmt
    names = open_checkpoint(str(tmp_path)).tensor_names()
    assert f"model.layers.0.mlp.down_proj.{tensor}" in names
    ids = random_prompt()
    ref = hf_logits(reference, ids)
    got = ours(tmp_path, ids)
    assert rel_err(got, ref) < 1e-5, f"{case}: relative error {rel_err(got, ref):.2e}"
    # The quantization changed the model: reading the stored integers as weights, or the scales wrong, would not
    # give these logits.
    assert rel_err(hf_logits(tiny_llama(), ids), ref) > 1e-3


def _mixtral():
    torch.manual_seed(0)
    config = transformers.MixtralConfig(**{**LLAMA, "intermediate_size": 64}, num_local_experts=4,
                                        num_experts_per_tok=2)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if p.ndim == 1 else p.normal_(0.0, 0.15)
    return model.eval()


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_fine_grained_fp8_checkpoint_reads_as_transformers_reads_it(tmp_path, family):
    """transformers' FP8 form (quant_method fp8: float8 weights, a float32 `weight_scale_inv` per 32 x 32 block),
    dequantized by transformers' own loader on the CPU; a Mixtral's experts one tensor each, as its checkpoints
    store them, its router left unquantized."""
    from safetensors.torch import load_file, save_file

    model = tiny_llama() if family == "llama" else _mixtral()
    model.save_pretrained(tmp_path / "plain")
    tensors = {}
    for name, p in load_file(tmp_path / "plain" / "model.safetensors").items():  # the names as stored
        if p.ndim == 2 and name.endswith(("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")):
            N, K = p.shape
            blocks = p.reshape(N // 32, 32, K // 32, 32)
            scale = blocks.abs().amax((1, 3)) / 448.0
            q = (blocks / scale[:, None, :, None]).reshape(N, K).to(torch.float8_e4m3fn)
            tensors[name], tensors[name + "_scale_inv"] = q, scale.float()
        else:
            tensors[name] = p.contiguous()
    assert sum(k.endswith("_scale_inv") for k in tensors) == (7 if family == "llama" else 4 + 12) * 2
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "plain" / "config.json").read_text()) | {"quantization_config": {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
        "modules_to_not_convert": ["lm_head", "gate"]}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert reference.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32  # dequantized at load
    ids = random_prompt()
    ref = hf_logits(reference, ids)
    assert rel_err(ours(tmp_path, ids), ref) < 1e-5
    assert rel_err(hf_logits(model, ids), ref) > 1e-3


def test_unpacking_matches_compressed_tensors_packing():
    """Every width from 1 to 8 bits, rows whose values straddle int32 words."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    rng = np.random.default_rng(0)
    for bits in range(1, 9):
        values = rng.integers(-(1 << (bits - 1)), 1 << (bits - 1), (5, 37)).astype(np.int8)
        packed = pack_to_int32(torch.from_numpy(values), bits).numpy()
        np.testing.assert_array_equal(unpack_int32(packed, bits, 37), values)


@pytest.mark.parametrize("quant, message", [
    ({"quant_method": "bitsandbytes"}, "a bitsandbytes quantization_config that loads neither 4- nor 8-bit"),
    ({"quant_method": "hqq"}, "quant_method 'hqq'"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                           "group_size": 16}}}}, "format 'nvfp4-pack-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                           "dynamic": True}}}}, "(dynamic)"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "transform_config": {"x": {}},
      "config_groups": {"g": {"weights": {"num_bits": 4, "strategy": "channel"}}}}, "transform_config"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "format 'e5m2'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 4, "strategy": "group", "group_size": 128, "actorder": "group"}}}},
     "activation order"),
])
def test_unsupported_quantization_is_refused_by_name(quant, message):
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 160, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256, "quantization_config": quant}
    with pytest.raises(UnsupportedModelError, match=re.escape(message)):
        ModelConfig.from_hf(config)


def test_a_missing_scale_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    compressed_tensors_checkpoint(tmp_path, "FP8_DYNAMIC")
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight_scale"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=re.escape(
            "quantized weight model.layers.1.mlp.up_proj is missing model.layers.1.mlp.up_proj.weight_scale")):
        ours(tmp_path, [1, 2, 3])


def test_the_quantization_flag_names_the_checkpoints_own_method(tmp_path):
    """`--quantization` on a quantized checkpoint must name its own method (or the form its weights are held in:
    tests/test_quantized_kept.py); 4-bit groups are read dequantized."""
    from jaxserve.engine.model_loading import check_quantization

    compressed_tensors_checkpoint(tmp_path, "W4A16", group_size=32)
    config = json.loads((tmp_path / "config.json").read_text())
    cfg = ModelConfig.from_hf(config)
    assert check_quantization(None, str(tmp_path), config, cfg) == (None, None)
    assert check_quantization("compressed-tensors", str(tmp_path), config, cfg) == (None, None)
    # Its 4-bit weights are dequantized at load, so they may be held quantized again as fp8; another method is refused.
    assert check_quantization("fp8", str(tmp_path), config, cfg) == ("fp8", None)
    with pytest.raises(UnsupportedModelError, match="quantization 'awq' does not match .*quantized with "
                                                    "'compressed-tensors'"):
        check_quantization("awq", str(tmp_path), config, cfg)
    # On an unquantized checkpoint fp8 quantizes at load (tests/test_quantized.py); a method that cannot is refused.
    assert check_quantization("fp8", "plain", {}) == (None, "fp8")
    with pytest.raises(UnsupportedModelError, match="its weights are not quantized. jaxserve .* quantizes an "
                                                    "unquantized checkpoint's weights at load with fp8, int8"):
        check_quantization("gptq", "plain", {})
