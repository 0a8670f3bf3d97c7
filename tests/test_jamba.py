"""Jamba (`JambaForCausalLM`, `config_jamba`) against HF transformers: Mamba layers of the first, selective-scan form
(`models.mamba1`: a low-rank step and B, C from x, each RMSNormed; A per channel and state dim) beside attention
layers without a rotary embedding, every other layer's MLP softmax-routed experts (the top k unrenormalized), the
others dense. Logits (and not them with the top k renormalized), the checkpoint written back, the engine's greedy
tokens (the prompts scanned token by token, the decode loop's states stepped at once) and its prefix cache's kept
states; what it refuses."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxserve.config import ModelConfig, UnsupportedModelError  # noqa: E402
from tests.fake_model import VOCAB  # noqa: E402
from tests.modelrun import prompt_logits  # noqa: E402
from tests.test_engine_gemma import hf_greedy  # noqa: E402
from tests.test_hybrid import NEW_TOKENS, PROMPTS, _engine, _greedy, _run  # noqa: E402
from tests.test_model_families import assert_written_back, hf_logits, rel_err, tiny_loaded  # noqa: E402

# Four layers: Mamba (128 channels, states of 8, a step of rank 8), attention (4 heads of 16 over 2 KV heads), Mamba,
# attention; layers 1 and 3 with 4 experts (top 2), layers 0 and 2 a dense MLP.
TINY = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
            vocab_size=VOCAB, attn_layer_period=2, attn_layer_offset=1, num_experts=4, num_experts_per_tok=2,
            expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8, mamba_dt_rank=8, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, max_position_embeddings=256)


@pytest.fixture(scope="module")
def jamba(tmp_path_factory):
    path, model, cfg, params = tiny_loaded(tmp_path_factory, "JambaConfig", "jamba", **TINY)
    return model, cfg, params, path


def test_config_reads_the_layers_and_experts(jamba):
    _, cfg, params, _ = jamba
    m = cfg.mamba
    assert (m.kind, m.layers, cfg.attention_layers, m.inner, m.state_size, m.dt_rank) == (
        "mamba1", (0, 2), (1, 3), 128, 8, 8)
    assert (cfg.num_experts, cfg.moe_layer_step, cfg.norm_topk_prob, cfg.no_rope_layers) == (4, 2, False, (0,) * 4)
    assert params.mamba_layers.m_a_log.shape == (2, 128, 8) and params.mamba_layers.m_x.shape == (2, 128, 8 + 16)
    assert params.dense_layers.w_gate.shape == (2, 64, 96) and params.mlp_layers.we_gate.shape[:2] == (2, 4)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    hf = cfg.to_hf()
    dense = ModelConfig.from_hf({**hf, "num_experts": 1})  # (one expert: every MLP dense)
    assert (dense.num_experts, dense.moe_layer_step) == (0, 1)
    for bad, match in ((dict(expert_layer_offset=0), "expert_layer_offset"), (dict(hidden_act="gelu"), "gelu"),
                       (dict(attn_layer_offset=2), "attn_layer_offset")):
        with pytest.raises(UnsupportedModelError, match=match):
            ModelConfig.from_hf({**hf, **bad})


def test_logits_match_transformers(jamba):
    """Transformers' logits, the prompt scanned token by token (the XLA backend's) and chunk by chunk (the Pallas
    ones', here interpreted); the experts' top k renormalized, they are not."""
    model, cfg, params, _ = jamba
    ids = (PROMPTS[2] + PROMPTS[0]) * 2
    ours, ref = prompt_logits(cfg, params, ids), hf_logits(model, ids)
    assert rel_err(ours, ref) < 1e-4 and (ours.argmax(-1) == ref.argmax(-1)).all()
    assert rel_err(prompt_logits(cfg, params, ids, backend="pallas_interpret"), ref) < 1e-4
    assert rel_err(prompt_logits(dataclasses.replace(cfg, norm_topk_prob=True), params, ids), ref) > 1e-3


def test_checkpoint_written_back_reads_the_same(jamba):
    """Every tensor under Jamba's names (Bamba's `feed_forward`, `pre_ff_layernorm`, `final_layernorm`; the
    experts one by one, as transformers saves them), exactly."""
    _, cfg, params, path = jamba
    assert_written_back(path, cfg, params)


def test_engine_greedy_equals_transformers(jamba):
    """Chunked prefills beside decodes and the device's decode loop, three requests in one batch, and again from
    the prefix cache's kept states: transformers' greedy tokens; every state slot back. Adapters are refused by
    name."""
    from jaxserve.engine.lora_manager import LoRAError

    model, cfg, params, path = jamba
    expected = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    engine = _engine(cfg, params, path)
    assert engine.runner.kv.ssm.shape[:5] == (2, 1 + 4 + 4, 128, 1, 8) and engine.runner.kv.k.shape[0] == 2
    assert _greedy(engine) == expected
    assert _run(engine, PROMPTS[2], "again") == (expected[2], 24)  # (its states kept at 24 of its 30 tokens)
    assert sorted(engine.scheduler.states.free) == [1, 2, 3, 4]
    engine.check_integrity()
    with pytest.raises(LoRAError, match=r"LoRA adapters on jamba \(its experts in every other layer\)"):
        _engine(cfg, params, path, enable_lora=True, max_lora_rank=8)
