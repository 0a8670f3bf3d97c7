"""bitsandbytes checkpoints, made by transformers with bitsandbytes itself from a tiny random Llama: 4-bit NF4 with
double quantization and FP4 without give the logits of the float model holding bitsandbytes' own dequantization of
each weight (`dequantize_4bit`; bitsandbytes 0.50's CPU 4-bit matmul no longer computes on those weights in float32:
1.3e-2 from them); 8-bit (LLM.int8()) ones are held as int8 with a scale per channel and give the logits of the float
model holding bitsandbytes' dequantization of them."""

from __future__ import annotations

import dataclasses
import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
bitsandbytes = pytest.importorskip("bitsandbytes")

import jax.numpy as jnp  # noqa: E402

from jaxserve.engine.model_loading import check_quantization  # noqa: E402
from jaxserve.loader import CheckpointError, load_params, open_checkpoint  # noqa: E402
from jaxserve.models.quantized import QuantizedWeight  # noqa: E402
from tests.test_model_families import hf_logits, prompt_logits, random_prompt, rel_err  # noqa: E402
from tests.test_quantized_checkpoints import ours, tiny_llama  # noqa: E402


def _saved(tmp_path, name: str, **bnb) -> tuple[object, object]:
    """The float model saved, then loaded quantized by transformers and saved again: (quantized model, its dir)."""
    src, out = tmp_path / "float", tmp_path / name
    if not src.exists():
        tiny_llama().save_pretrained(src)
    config = transformers.BitsAndBytesConfig(bnb_4bit_compute_dtype=torch.float32, **bnb)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, quantization_config=config, device_map="cpu",
                                                              dtype=torch.float32).eval()
    model.save_pretrained(out)
    return model, out


@pytest.mark.parametrize("quant_type,double", [("nf4", True), ("fp4", False)])
def test_4bit_checkpoint_gives_the_logits_of_its_dequantized_weights(tmp_path, quant_type, double):
    model, path = _saved(tmp_path, quant_type, load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                         bnb_4bit_use_double_quant=double)
    names = open_checkpoint(str(path)).tensor_names()
    assert f"model.layers.0.mlp.up_proj.weight.quant_state.bitsandbytes__{quant_type}" in names
    assert ("model.layers.0.mlp.up_proj.weight.nested_absmax" in names) is double
    from bitsandbytes.functional import dequantize_4bit

    reference = tiny_llama()
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, bitsandbytes.nn.Linear4bit):
                w = dequantize_4bit(module.weight.data, module.weight.quant_state)
                reference.get_submodule(name).weight.copy_(w.float())
    ids = random_prompt()
    want = hf_logits(reference, ids)
    assert rel_err(ours(path, ids), want) < 1e-4
    assert rel_err(hf_logits(tiny_llama(), ids), want) > 1e-3  # (the float model's are not: 4 bits matter)
    assert check_quantization(None, str(path), json.loads((path / "config.json").read_text())) == (None, None)


def test_8bit_checkpoint_is_held_as_int8(tmp_path):
    from bitsandbytes.functional import int8_vectorwise_dequant

    model, path = _saved(tmp_path, "int8", load_in_8bit=True)
    reference = tiny_llama()  # the float model with bitsandbytes' dequantization of each int8 weight
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, bitsandbytes.nn.Linear8bitLt):
                w = int8_vectorwise_dequant(module.weight.data, module.weight.SCB)
                reference.get_submodule(name).weight.copy_(w.float())
    ids = random_prompt()
    ckpt = open_checkpoint(str(path))
    cfg = ckpt.config()
    form, _ = check_quantization(None, str(path), ckpt.hf_config, cfg)
    assert form == "int8"  # held as stored: its int8 values and a scale per channel
    held = dataclasses.replace(cfg, weight_quant=form)
    params = load_params(ckpt, held, jnp.float32, progress=False)
    assert isinstance(params.layers.wq, QuantizedWeight) and params.layers.wq.q.dtype == jnp.int8
    assert rel_err(prompt_logits(held, params, ids), hf_logits(reference, ids)) < 1e-4
    assert rel_err(ours(path, ids), hf_logits(reference, ids)) < 1e-4  # dequantized at load


def test_a_4bit_weight_without_its_state_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    _, path = _saved(tmp_path, "nf4", load_in_4bit=True, bnb_4bit_quant_type="nf4")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.o_proj.weight.absmax"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="quantized weight model.layers.1.self_attn.o_proj is missing "
                                              "model.layers.1.self_attn.o_proj.weight.absmax"):
        ours(path, random_prompt())
