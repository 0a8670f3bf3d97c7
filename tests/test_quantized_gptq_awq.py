"""GPTQ and AWQ checkpoints: a tiny random Llama's linear layers quantized to 4 (and 2 and 8) bits per group of
input rows and packed as AutoGPTQ / GPTQModel and AutoAWQ store them; our logits equal the float model holding the
dequantized weights. AutoAWQ's interleaved packing is also read through compressed-tensors' own AutoAWQ converter,
independently of this file's packing."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxserve.config import ModelConfig, UnsupportedModelError  # noqa: E402
from jaxserve.quantization import dequantize, parse_quantization  # noqa: E402
from tests.test_model_families import hf_logits, random_prompt, rel_err  # noqa: E402
from tests.test_quantized_checkpoints import ours, tiny_llama  # noqa: E402

GROUP = 32
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ packs column AWQ_ORDER[i] of each 8 into bits 4i


def quantize(w: np.ndarray, bits: int, sym: bool, rng, group: int = GROUP
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """w [N, K] per group of `group` input columns (-1: all), in a random group order (activation order): the
    integers [K, N], zero points and scales [groups, N], and each input row's group."""
    N, K = w.shape
    group = K if group < 0 else group
    top = (1 << bits) - 1
    g_idx = rng.permutation(np.arange(K) // group)
    scales, zeros = np.zeros((K // group, N), np.float32), np.zeros((K // group, N), np.int64)
    for g in range(K // group):
        cols = w[:, g_idx == g]
        if sym:
            s = np.abs(cols).max(1) / ((top + 1) // 2 - 0.5)
            z = np.full(N, (top + 1) // 2)
        else:
            lo, hi = cols.min(1), cols.max(1)
            s = (hi - lo) / top
            z = np.clip(np.round(-lo / s), 0, top)
        scales[g], zeros[g] = s.astype(np.float16), z
    q = np.clip(np.round(w.T / scales[g_idx]) + zeros[g_idx], 0, top).astype(np.int64)  # [K, N]
    return q, zeros, scales, g_idx


def pack(values: np.ndarray, bits: int, axis: int, order=None) -> np.ndarray:
    """Unsigned `bits`-bit integers packed into int32 along `axis`, value i of each word at bits i * bits (with
    `order`, the word's value i is its column order[i])."""
    per = 32 // bits
    v = np.moveaxis(values, axis, -1)
    v = v.reshape(*v.shape[:-1], -1, per)
    if order is not None:
        v = v[..., order]
    words = (v.astype(np.uint64) << (np.arange(per, dtype=np.uint64) * bits)).sum(-1).astype(np.uint32)
    return np.moveaxis(words.view(np.int32), -1, axis)


def quantized_checkpoint(path, method: str, bits: int = 4, sym: bool = False, act_order: bool = False,
                         fmt: str = "gptq", group: int = GROUP):
    """A tiny Llama's linear layers (not the LM head) quantized, packed and saved as `method` stores them;
    returns the float model holding the dequantized weights."""
    from safetensors.torch import save_file

    model = tiny_llama()
    rng = np.random.default_rng(0)
    tensors, config = {}, model.config.to_dict()
    for name, p in model.state_dict().items():
        module = name.removesuffix(".weight")
        if not (name.endswith("proj.weight") and p.ndim == 2):
            tensors[name] = p.contiguous()
            continue
        q, zeros, scales, g_idx = quantize(p.numpy(), bits, sym, rng, group)
        if not act_order:
            order = np.argsort(g_idx, kind="stable")  # rows in order: regroup the quantization by index
            q, g_idx = q[order], g_idx[order]
            p = p[:, torch.as_tensor(order)]
        deq = ((q - zeros[g_idx]) * scales[g_idx]).T.astype(np.float32)
        if method == "awq":
            tensors[f"{module}.qweight"] = torch.from_numpy(pack(q, 4, 1, AWQ_ORDER))
            tensors[f"{module}.qzeros"] = torch.from_numpy(pack(zeros, 4, 1, AWQ_ORDER))
        else:
            tensors[f"{module}.qweight"] = torch.from_numpy(pack(q, bits, 0))
            stored = zeros - (fmt == "gptq")  # the "gptq" format stores each zero point minus one
            tensors[f"{module}.qzeros"] = torch.from_numpy(pack(stored & ((1 << bits) - 1), bits, 1))
            tensors[f"{module}.g_idx"] = torch.from_numpy(g_idx.astype(np.int32))
        tensors[f"{module}.scales"] = torch.from_numpy(scales.astype(np.float16))
        with torch.no_grad():
            model.get_parameter(name).copy_(torch.from_numpy(deq))
    if method == "awq":
        quant = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": not sym, "version": "gemm"}
    else:
        quant = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym, "desc_act": act_order,
                 "checkpoint_format": fmt}
    config["quantization_config"] = quant
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return model.eval()


@pytest.mark.parametrize("method,bits,sym,act_order,fmt", [
    ("awq", 4, False, False, None),
    ("gptq", 4, True, False, "gptq"),
    ("gptq", 4, False, True, "gptq"),  # rows quantized in activation order: each row's group from g_idx
    ("gptq", 8, False, False, "gptq_v2"),
    ("gptq", 2, True, True, "gptq"),
])
def test_gptq_and_awq_checkpoints_read_as_stored(tmp_path, method, bits, sym, act_order, fmt):
    reference = quantized_checkpoint(tmp_path, method, bits, sym, act_order, fmt)
    ids = random_prompt()
    ref = hf_logits(reference, ids)
    assert rel_err(ours(tmp_path, ids), ref) < 1e-5
    assert rel_err(hf_logits(tiny_llama(), ids), ref) > 1e-3  # the quantization changed the model


def test_awq_packing_reads_as_compressed_tensors_converts_it(tmp_path):
    """compressed-tensors' AutoAWQ converter turns the same tensors into its own packed form, which the
    compressed-tensors reader dequantizes: the two weights are equal."""
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter
    from safetensors.torch import load_file

    quantized_checkpoint(tmp_path, "awq")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    module = "model.layers.1.mlp.down_proj"
    parts = {k.rsplit(".", 1)[1]: v.numpy() for k, v in tensors.items() if k.startswith(module + ".")}
    awq = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    ours_w = dequantize(parse_quantization(awq).scheme(module), parts, module)
    converter = AutoAWQConverter.from_autoawq_config(awq)
    converted = converter.process({f"{module}.{k}": torch.from_numpy(v) for k, v in parts.items()})
    ct = parse_quantization(converter.update_config(None).model_dump())
    ct_parts = {k.rsplit(".", 1)[1]: v.numpy() for k, v in converted.items()}
    np.testing.assert_allclose(ours_w, dequantize(ct.scheme(module), ct_parts, module), rtol=0, atol=1e-6)


@pytest.mark.parametrize("quant,message", [
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version 'gemv'"),
    ({"quant_method": "gptq", "bits": 3}, "3-bit weights"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "format 'marlin'"),
    ({"quant_method": "gptq", "bits": 4, "dynamic": {"-:.*mlp.*": {}}}, "dynamic per-module settings"),
])
def test_unsupported_gptq_and_awq_are_refused_by_name(quant, message):
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 160, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256, "quantization_config": quant}
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_hf(config)
