"""Damaged or unsupported checkpoints: each is refused with a message that names the problem."""

from __future__ import annotations

import json
import os
import re

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxserve.config import ModelConfig, UnsupportedModelError
from jaxserve.loader import CheckpointError, load_params, open_checkpoint, resolve_model
from jaxserve.loader.keymap import hf_names, hf_target

CFG = ModelConfig(
    family="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=False,
)


def hf_tensors(cfg: ModelConfig = CFG) -> dict[str, np.ndarray]:
    """A complete, valid set of HF-named random tensors for `cfg` (shapes from the key map)."""
    rng = np.random.default_rng(0)
    return {name: rng.standard_normal(hf_target(name, cfg).hf_shape).astype(np.float32) for name in hf_names(cfg)}


def write_hf_dir(path, shards: list[dict[str, np.ndarray]], config: dict | None = None) -> str:
    """config.json (CFG's unless given) and one safetensors file per shard, without an index."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config if config is not None else CFG.to_hf(), f)
    for i, shard in enumerate(shards):
        save_file(shard, os.path.join(path, f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"))
    return str(path)


def load(path: str):
    ckpt = open_checkpoint(path)
    return load_params(ckpt, ckpt.config(), jnp.float32, progress=False)


def test_valid_directory_loads(tmp_path):
    """The fixture itself is sound, so each refusal below is caused by its one defect."""
    tensors = hf_tensors()
    names = sorted(tensors)
    params = load(write_hf_dir(tmp_path, [{n: tensors[n] for n in names[::2]}, {n: tensors[n] for n in names[1::2]}]))
    np.testing.assert_array_equal(np.asarray(params.lm_head), tensors["lm_head.weight"].T)


def test_truncated_gguf(tmp_path, smollm_path):
    # Cut inside the header (4 KiB: its vocabulary) and inside the tensor data (4 MiB).
    for size, message in ((4096, r"not a readable GGUF file \(truncated or damaged\?\): cannot parse the GGUF header"),
                          (4 << 20, r"is truncated: its tensors need 98362432 bytes, the file has 4194304")):
        path = tmp_path / f"cut-{size}.gguf"
        with open(smollm_path, "rb") as src, open(path, "wb") as dst:
            dst.write(src.read(size))
        with pytest.raises(CheckpointError, match=message) as info:
            open_checkpoint(str(path))
        assert str(path) in str(info.value)
    path = tmp_path / "not.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(CheckpointError, match=r"not a GGUF file \(magic b'GGML', expected b'GGUF'\)"):
        open_checkpoint(str(path))


def test_wrong_shape(tmp_path):
    tensors = hf_tensors()
    tensors["model.layers.1.self_attn.k_proj.weight"] = np.zeros((24, 32), np.float32)
    with pytest.raises(CheckpointError, match=re.escape(
            "tensor 'model.layers.1.self_attn.k_proj.weight' has shape (24, 32), expected (16, 32)")):
        load(write_hf_dir(tmp_path, [tensors]))


def test_missing_tensor(tmp_path):
    tensors = hf_tensors()
    del tensors["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(CheckpointError, match=re.escape(
            "checkpoint is missing 1 tensor(s): model.layers.0.mlp.up_proj.weight")):
        load(write_hf_dir(tmp_path, [tensors]))


def test_missing_lm_head_of_untied_model(tmp_path):
    tensors = hf_tensors()
    del tensors["lm_head.weight"]
    with pytest.raises(CheckpointError, match=re.escape("missing 1 tensor(s): lm_head.weight")):
        load(write_hf_dir(tmp_path, [tensors]))


@pytest.mark.parametrize("name, expected", [
    ("model.layers.0.self_attn.rotary_gate.weight", "unknown tensor 'model.layers.0.self_attn.rotary_gate.weight'"),
    ("model.layers.7.mlp.up_proj.weight", "names layer 7, but the model has 2 layers"),
    ("model.layers.0.self_attn.q_norm.weight", "unknown tensor 'model.layers.0.self_attn.q_norm.weight' for a llama"),
])
def test_unknown_extra_tensor(tmp_path, name, expected):
    tensors = hf_tensors()
    tensors[name] = np.zeros((8,), np.float32)
    with pytest.raises(CheckpointError, match=re.escape(expected)):
        load(write_hf_dir(tmp_path, [tensors]))


def test_duplicated_tensor_across_shards(tmp_path):
    tensors = hf_tensors()
    dup = "model.layers.1.mlp.down_proj.weight"
    with pytest.raises(CheckpointError, match=re.escape(f"tensor {dup!r} appears twice")):
        load(write_hf_dir(tmp_path, [tensors, {dup: tensors[dup]}]))


def test_index_naming_a_missing_shard(tmp_path):
    write_hf_dir(tmp_path, [hf_tensors()])
    weight_map = {name: "model-00001-of-00002.safetensors" for name in hf_tensors()}
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(FileNotFoundError, match="missing shard.*model-00002-of-00002.safetensors"):
        open_checkpoint(str(tmp_path))


def test_unsupported_architecture(tmp_path):
    config = {**CFG.to_hf(), "architectures": ["RwkvForCausalLM"], "model_type": "rwkv"}
    ckpt = open_checkpoint(write_hf_dir(tmp_path, [hf_tensors()], config))
    with pytest.raises(UnsupportedModelError, match=r"'RwkvForCausalLM'.*not supported.*LlamaForCausalLM"):
        ckpt.config()


@pytest.mark.parametrize("rope, message", [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_scaling type 'dynamic' is not supported"),
    ({"type": "longrope", "long_factor": [1.0], "short_factor": [1.0]},
     r"rope scaling short_factor has 1 values; the \d+ rotary dims of head_dim \d+ make \d+ pairs"),
])
def test_unsupported_rope_scaling(tmp_path, rope, message):
    config = {**CFG.to_hf(), "rope_scaling": rope}
    ckpt = open_checkpoint(write_hf_dir(tmp_path, [hf_tensors()], config))
    with pytest.raises(UnsupportedModelError, match=message):
        ckpt.config()


def test_missing_config_json(tmp_path):
    save_file(hf_tensors(), str(tmp_path / "model.safetensors"))
    with pytest.raises(FileNotFoundError, match=f"no config.json in {re.escape(str(tmp_path))}"):
        open_checkpoint(str(tmp_path))


def test_no_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CFG.to_hf()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0" * 16)
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights .*only safetensors are supported"):
        open_checkpoint(str(tmp_path))


def test_resolve_model_missing_path_says_no_download(tmp_path):
    missing = str(tmp_path / "HuggingFaceTB" / "SmolLM2-360M")
    with pytest.raises(FileNotFoundError, match="never downloads") as info:
        resolve_model(missing)
    assert missing in str(info.value)


def _tiny_gguf(path, arch: str, tensor_type=None) -> str:
    """A small GGUF with llama-style metadata and one embedding tensor of `tensor_type`."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_embedding_length(32)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_feed_forward_length(48)
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_token_list([f"t{i}" for i in range(64)])
    qtype = tensor_type or gguf.GGMLQuantizationType.F32
    if qtype == gguf.GGMLQuantizationType.F32:
        w.add_tensor("token_embd.weight", np.zeros((64, 32), np.float32))
    else:
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        raw = np.zeros((64, 32 // block * nbytes), np.uint8)  # the bytes of a [64, 32] tensor
        w.add_tensor("token_embd.weight", raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_gguf_unsupported_architecture(tmp_path):
    ckpt = open_checkpoint(_tiny_gguf(tmp_path / "m.gguf", "rwkv6"))
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'rwkv6' is not supported"):
        ckpt.config()


def test_gguf_unsupported_tensor_type(tmp_path):
    import gguf

    ckpt = open_checkpoint(_tiny_gguf(tmp_path / "m.gguf", "llama", gguf.GGMLQuantizationType.Q8_1))
    cfg = ckpt.config()
    with pytest.raises(CheckpointError, match="'token_embd.weight' has type Q8_1, not supported"):
        load_params(ckpt, cfg, jnp.float32, progress=False)
