"""Phi-1, Phi-1.5 and Phi-2 (`PhiForCausalLM`) against transformers: a tiny random model with attention and an
ungated tanh-GELU MLP (`fc1`, `fc2`) side by side on one LayerNorm with a bias, every projection biased (the
attention's output is `dense`), half of each head rotated, a final LayerNorm (`final_layernorm`) and a biased LM
head; its `qk_layernorm` variant. Logits (and not them without the head's bias), greedy tokens through
the engine, the checkpoint and config written back under its own names, a LoRA adapter on `dense`, `fc1` and `fc2`
against PEFT, and llama.cpp's "phi2" files (q, k and v apart, or fused as in files of its first checkpoints)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from jaxserve.config import ModelConfig  # noqa: E402
from jaxserve.engine.llm_engine import LLMEngine  # noqa: E402
from jaxserve.engine_args import EngineArgs  # noqa: E402
from jaxserve.loader import open_checkpoint  # noqa: E402
from tests.fake_model import save_fake_tokenizer  # noqa: E402
from tests.modelrun import prompt_logits  # noqa: E402
from tests.test_gguf_models import _ours, shaped_writer, written  # noqa: E402
from tests.test_lora import PEFT_ARGS, VOCAB, _adapter, adapter_equals_peft  # noqa: E402
from tests.test_model_families import (  # noqa: E402
    assert_engine_greedy,
    assert_logits_match,
    assert_written_back,
    rel_err,
    save_tiny_hf,
    tiny_loaded,
)

SETTINGS = dict(partial_rotary_factor=0.5, bos_token_id=1, eos_token_id=2)
# HF Phi's module names as llama.cpp's converter names them.
GGUF_NAMES = {"embed_tokens": "token_embd", "final_layernorm": "output_norm", "input_layernorm": "attn_norm",
              "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "dense": "attn_output", "fc1": "ffn_up",
              "fc2": "ffn_down", "lm_head": "output"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_loaded(tmp_path_factory, "PhiConfig", "phi", **SETTINGS)


def test_phi_config(tiny):
    _, _, cfg, params = tiny
    assert (cfg.family, cfg.hidden_act, cfg.gated_mlp, cfg.parallel_block, cfg.rotary_dims, cfg.head_dim) == (
        "phi", "gelu_pytorch_tanh", False, True, 8, 16)
    assert (cfg.attention_bias, cfg.output_bias, cfg.mlp_bias, cfg.norm_bias, cfg.tie_word_embeddings) == (
        True, True, True, True, False)
    assert params.lm_head_b.shape == (cfg.vocab_size,) and params.layers.mlp_norm is params.layers.mlp_norm_b is None
    hf = cfg.to_hf()
    assert (hf["model_type"], hf["hidden_act"], hf["partial_rotary_factor"]) == ("phi", "gelu_pytorch_tanh", 0.5)
    assert ModelConfig.from_hf(hf) == cfg and hf["qk_layernorm"] is False and cfg.qk_norm is False


def test_phi_logits_match_transformers(tiny):
    """Transformers' logits; without the head's bias they are not."""
    _, model, cfg, params = tiny
    ids, ref = assert_logits_match(model, cfg, params)
    assert rel_err(prompt_logits(cfg, dataclasses.replace(params, lm_head_b=None), ids), ref) > 1e-3


def test_phi_checkpoint_written_back_reads_the_same(tiny):
    path, _, cfg, params = tiny
    assert_written_back(path, cfg, params)  # (`dense`, `fc1`, `fc2`, `final_layernorm`, `lm_head.bias`: exactly)


def test_phi_engine_greedy_equals_transformers(tiny):
    _, model, cfg, params = tiny
    assert_engine_greedy(model, cfg, params, "scan")


def test_phi_qk_layernorm_logits_checkpoint_and_engine(tmp_path_factory):
    """`qk_layernorm`: each head's q and k LayerNormed (a weight and a bias over its dims, shared by the heads) before
    the rotation; transformers' logits (and not them without the norms' biases), the checkpoint written back under
    its names (`q_layernorm`, `k_layernorm`), greedy tokens through the engine."""
    path, model, cfg, params = tiny_loaded(tmp_path_factory, "PhiConfig", "phi_qk", qk_layernorm=True, **SETTINGS)
    assert cfg.qk_norm and params.layers.q_norm_b.shape == params.layers.k_norm.shape == (cfg.num_layers, cfg.head_dim)
    hf = cfg.to_hf()
    assert hf["qk_layernorm"] is True and ModelConfig.from_hf(hf) == cfg
    ids, ref = assert_logits_match(model, cfg, params)
    layers = dataclasses.replace(params.layers, q_norm_b=None, k_norm_b=None)
    assert rel_err(prompt_logits(cfg, dataclasses.replace(params, layers=layers), ids), ref) > 1e-3
    assert_written_back(path, cfg, params)
    assert_engine_greedy(model, cfg, params, "scan")


def test_phi_adapter_on_attention_and_mlp_equals_peft(tmp_path):
    """PEFT's adapter on q, `dense`, `fc1` and `fc2`: its prompt logprobs and greedy tokens."""
    import transformers

    base = str(tmp_path / "base")
    save_tiny_hf("PhiConfig", base, vocab_size=VOCAB, **SETTINGS)
    save_fake_tokenizer(base)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = _adapter(hf, str(tmp_path / "a"), 3, r=4, lora_alpha=8, target_modules=["q_proj", "dense", "fc1", "fc2"])
    engine = LLMEngine(EngineArgs(model=base, lora_modules=(("a", str(tmp_path / "a")),), **PEFT_ARGS), progress=False)
    adapter_equals_peft(engine, model, "a", 7, atol=2e-5)


@pytest.mark.parametrize("fused", [False, True])
def test_phi2_gguf_equals_the_hf_model(tiny, tmp_path, fused):
    """A "phi2" GGUF file as llama.cpp's converter writes one (q, k and v apart; or, `fused`, one `attn_qkv` weight
    and bias): the model's config and logits."""
    from safetensors.numpy import load_file

    path, model, cfg, _ = tiny
    c = model.config
    w = shaped_writer(tmp_path / "phi2.gguf", "phi2", c)
    w.add_layer_norm_eps(c.layer_norm_eps)
    w.add_rope_dimension_count(cfg.rotary_dims)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    tensors = load_file(path / "model.safetensors")
    qkv: dict[tuple[str, str], dict[str, np.ndarray]] = {}
    for name, a in tensors.items():
        parts = name.split(".")
        if fused and parts[-2] in ("q_proj", "k_proj", "v_proj"):
            qkv.setdefault((parts[2], parts[-1]), {})[parts[-2]] = a
            continue
        block = f"blk.{parts[2]}." if parts[1] == "layers" else ""
        w.add_tensor(f"{block}{GGUF_NAMES[parts[-2] if len(parts) > 2 else parts[0]]}.{parts[-1]}", a)
    for (layer, field), by in qkv.items():
        w.add_tensor(f"blk.{layer}.attn_qkv.{field}", np.concatenate([by["q_proj"], by["k_proj"], by["v_proj"]]))
    gguf = open_checkpoint(written(w, tmp_path / "phi2.gguf"))
    assert dataclasses.replace(gguf.config(), rms_norm_eps=cfg.rms_norm_eps) == cfg
    ids = np.random.default_rng(9).integers(0, c.vocab_size, 30).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(_ours(str(tmp_path / "phi2.gguf"), ids), ref, atol=1e-4 * np.abs(ref).max(), rtol=0)
