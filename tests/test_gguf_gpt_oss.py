"""gpt-oss from a llama.cpp GGUF file (architecture "gpt-oss"): its experts in MXFP4 stacked per projection with
their biases, the biased router, the attention sinks, the norm before the MLP under llama.cpp's post-attention
name, the window and YaRN from the metadata. The file is written as llama.cpp's converter lays one out; jaxserve's
config is the HF model's and its logits are those of the HF model holding the experts' MXFP4 values."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from jaxserve.loader import HFDirectory, open_checkpoint  # noqa: E402
from tests.test_gguf_models import _ours  # noqa: E402
from tests.test_model_families import hf_logits, random_prompt, rel_err, save_tiny_hf  # noqa: E402
from tests.test_moe import FAMILIES  # noqa: E402

MXFP4 = gguf.GGMLQuantizationType.MXFP4
# The tiny gpt-oss of tests/test_moe.py with the SwiGLU clamp llama.cpp applies to every gpt-oss file (7.0: a GGUF
# does not carry it).
CONFIG, OVERRIDES = FAMILIES["gpt_oss"][0], {k: v for k, v in FAMILIES["gpt_oss"][1].items() if k != "swiglu_limit"}
# llama.cpp's names of the HF tensors (per layer: after `model.layers.{i}.`).
NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
         "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
         "mlp.router.bias": "ffn_gate_inp.bias",
         **{f"self_attn.{p}_proj.{part}": f"attn_{n}.{part}" for p, n in (("q", "q"), ("k", "k"), ("v", "v"),
                                                                         ("o", "output")) for part in ("weight", "bias")}}


def _mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`w` [..., out, in] as MXFP4 blocks along `in` (the file's bytes) and the values they hold."""
    q = gguf.quants.quantize(np.ascontiguousarray(w, np.float32), MXFP4)
    return q, gguf.quants.dequantize(q, MXFP4).reshape(w.shape)


def write_gpt_oss_gguf(path, model) -> str:
    """The HF gpt-oss `model` as llama.cpp's converter writes it, its experts' weights in MXFP4 (`model` then holds
    the values the blocks hold): gate and up split out of the interleaved `gate_up_proj`, each projection's experts
    stacked output-major with their biases."""
    c = model.config
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    rope = c.rope_parameters
    for key, value in (("embedding_length", c.hidden_size), ("block_count", c.num_hidden_layers),
                       ("attention.head_count", c.num_attention_heads),
                       ("attention.head_count_kv", c.num_key_value_heads), ("attention.key_length", c.head_dim),
                       ("attention.value_length", c.head_dim), ("context_length", c.max_position_embeddings),
                       ("feed_forward_length", c.intermediate_size), ("expert_feed_forward_length", c.intermediate_size),
                       ("expert_count", c.num_local_experts), ("expert_used_count", c.num_experts_per_tok),
                       ("attention.sliding_window", c.sliding_window),
                       ("rope.scaling.original_context_length", rope["original_max_position_embeddings"])):
        w.add_uint32(f"gpt-oss.{key}", value)
    w.add_float32("gpt-oss.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    w.add_float32("gpt-oss.rope.freq_base", rope["rope_theta"])
    w.add_string("gpt-oss.rope.scaling.type", "yarn")
    w.add_float32("gpt-oss.rope.scaling.factor", rope["factor"])
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    state = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", state.pop("model.embed_tokens.weight"))
    w.add_tensor("output_norm.weight", state.pop("model.norm.weight"))
    w.add_tensor("output.weight", state.pop("lm_head.weight"))
    for i in range(c.num_hidden_layers):
        pre = f"model.layers.{i}."
        experts = {k.removeprefix(f"{pre}mlp.experts."): state.pop(k) for k in list(state)
                   if k.startswith(f"{pre}mlp.experts.")}
        gate_up, gate_up_bias = experts["gate_up_proj"], experts["gate_up_proj_bias"]  # [X, E, 2F], [X, 2F]
        weights = {"gate": gate_up[:, :, 0::2].transpose(0, 2, 1), "up": gate_up[:, :, 1::2].transpose(0, 2, 1),
                   "down": experts["down_proj"].transpose(0, 2, 1)}  # [X, out, in]
        biases = {"gate": gate_up_bias[:, 0::2], "up": gate_up_bias[:, 1::2], "down": experts["down_proj_bias"]}
        held = {}
        for kind, weight in weights.items():
            blocks, held[kind] = _mxfp4(weight)
            w.add_tensor(f"blk.{i}.ffn_{kind}_exps.weight", blocks, raw_dtype=MXFP4)
            w.add_tensor(f"blk.{i}.ffn_{kind}_exps.bias", biases[kind])
        with torch.no_grad():  # the HF model holds what the blocks hold
            packed = np.empty_like(gate_up)
            packed[:, :, 0::2], packed[:, :, 1::2] = held["gate"].transpose(0, 2, 1), held["up"].transpose(0, 2, 1)
            model.get_parameter(f"{pre}mlp.experts.gate_up_proj").copy_(torch.from_numpy(packed))
            model.get_parameter(f"{pre}mlp.experts.down_proj").copy_(torch.from_numpy(held["down"].transpose(0, 2, 1)))
        for name in [k for k in state if k.startswith(pre)]:
            w.add_tensor(f"blk.{i}.{NAMES[name.removeprefix(pre)]}", state.pop(name))
    assert not state, sorted(state)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_gpt_oss_gguf_config_and_logits_equal_the_hf_model(tmp_path):
    model = save_tiny_hf(CONFIG, tmp_path / "hf", **OVERRIDES)
    want = HFDirectory(str(tmp_path / "hf")).config()
    path = write_gpt_oss_gguf(tmp_path / "gpt-oss.gguf", model)
    cfg = open_checkpoint(path).config()
    assert cfg.rms_norm_eps == pytest.approx(want.rms_norm_eps, rel=1e-6)  # GGUF stores it in float32
    assert dataclasses.replace(cfg, rms_norm_eps=want.rms_norm_eps) == want
    assert cfg.rope_scaling.rope_type == "yarn" and not cfg.rope_scaling.truncate and cfg.attention_sinks
    ids = random_prompt()
    ref = hf_logits(model, ids)
    assert rel_err(_ours(path, ids), ref) < 1e-4
    # The experts' values are the MXFP4 blocks': the model's own float weights give other logits.
    original = save_tiny_hf(CONFIG, tmp_path / "hf2", **OVERRIDES)
    assert rel_err(hf_logits(original, ids), ref) > 1e-3
