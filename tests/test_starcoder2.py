"""StarCoder2 (`Starcoder2ForCausalLM`) against transformers: a tiny random model with Llama's attention and biases,
LayerNorms with biases, an ungated tanh-GELU MLP with biases (`c_fc`, `c_proj`) and Mistral's window over every
layer (8 here, so the 40-token prompt and the decodes run past it). Logits (and not them with the window off or the
MLP's activation changed), greedy tokens through the engine, the checkpoint and config written back under its own
names, and a LoRA adapter on its attention and `c_fc` / `c_proj` against PEFT."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from jaxserve.config import ModelConfig  # noqa: E402
from jaxserve.engine.llm_engine import LLMEngine  # noqa: E402
from jaxserve.engine_args import EngineArgs  # noqa: E402
from tests.fake_model import save_fake_tokenizer  # noqa: E402
from tests.modelrun import prompt_logits  # noqa: E402
from tests.test_lora import PEFT_ARGS, VOCAB, _adapter, adapter_equals_peft  # noqa: E402
from tests.test_model_families import (  # noqa: E402
    assert_engine_greedy,
    assert_logits_match,
    assert_written_back,
    rel_err,
    save_tiny_hf,
    tiny_loaded,
)

SETTINGS = dict(sliding_window=8, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_loaded(tmp_path_factory, "Starcoder2Config", "starcoder2", **SETTINGS)


def test_starcoder2_config(tiny):
    path, _, cfg, params = tiny
    assert (cfg.family, cfg.hidden_act, cfg.gated_mlp, cfg.sliding_window, cfg.layer_types) == (
        "starcoder2", "gelu_pytorch_tanh", False, 8, None)
    assert (cfg.attention_bias, cfg.output_bias, cfg.mlp_bias, cfg.norm_bias, cfg.tie_word_embeddings) == (True,) * 5
    assert params.layers.mlp_norm_b.shape == (cfg.num_layers, cfg.hidden_size) and params.layers.b_up is not None
    hf = cfg.to_hf()
    assert (hf["model_type"], hf["norm_epsilon"], hf["use_bias"], hf["sliding_window"]) == ("starcoder2", 1e-5, True, 8)
    assert "use_sliding_window" not in hf and ModelConfig.from_hf(hf) == cfg
    assert not ModelConfig.from_hf({**hf, "use_bias": False}).mlp_bias


def test_starcoder2_logits_match_transformers(tiny):
    """Transformers' logits; without the window, or with another ungated MLP's activation, they are not."""
    _, model, cfg, params = tiny
    ids, ref = assert_logits_match(model, cfg, params, {"sliding_window": None})
    relu2 = dataclasses.replace(cfg, hidden_act="relu2")
    assert rel_err(prompt_logits(relu2, params, ids), ref) > 1e-3


def test_starcoder2_checkpoint_written_back_reads_the_same(tiny):
    path, _, cfg, params = tiny
    assert_written_back(path, cfg, params)  # (`mlp.c_fc`, `mlp.c_proj`: its names, exactly)


def test_starcoder2_engine_greedy_equals_transformers(tiny):
    _, model, cfg, params = tiny
    assert_engine_greedy(model, cfg, params, "scan")


def test_starcoder2_adapter_on_attention_and_mlp_equals_peft(tmp_path):
    """PEFT's adapter on q, v, `c_fc` and `c_proj` (StarCoder2's up and down projections): its prompt logprobs and
    greedy tokens."""
    import torch
    import transformers

    base = str(tmp_path / "base")
    save_tiny_hf("Starcoder2Config", base, vocab_size=VOCAB, **SETTINGS)
    save_fake_tokenizer(base)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = _adapter(hf, str(tmp_path / "a"), 3, r=4, lora_alpha=8,
                     target_modules=["q_proj", "v_proj", "c_fc", "c_proj"])
    engine = LLMEngine(EngineArgs(model=base, lora_modules=(("a", str(tmp_path / "a")),), **PEFT_ARGS), progress=False)
    adapter_equals_peft(engine, model, "a", 7, atol=2e-5)
