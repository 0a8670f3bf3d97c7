"""Granite SWA (`GraniteSWAForCausalLM`, `config_granite_swa`) against HF transformers: Granite's layers and scalars,
three of four layers windowed (8 keys here), a learned sink logit per head on every layer, a rotary base per layer
kind (the full layer NoPE here, the windowed ones 5000). Logits of a 40-token prompt (and not them without the sinks,
the window or the windowed layers' own base), the engine's greedy tokens past the window, the checkpoint and config
written back, the bases refused by name where one kind has two."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from jaxserve.config import ModelConfig  # noqa: E402
from jaxserve.errors import UnsupportedModelError  # noqa: E402
from tests.modelrun import prompt_logits  # noqa: E402
from tests.test_model_families import (  # noqa: E402
    assert_engine_greedy,
    assert_logits_match,
    assert_written_back,
    hf_logits,
    random_prompt,
    rel_err,
    tiny_loaded,
)

TINY = dict(num_hidden_layers=4, head_dim=16, sliding_window=8, layer_rope_theta=[0, 5000.0, 5000.0, 5000.0],
            embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=3.0,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_loaded(tmp_path_factory, "GraniteSWAConfig", "granite_swa", **TINY)


def test_granite_swa_config(tiny):
    _, _, cfg, params = tiny
    assert cfg.layer_types == ("full_attention",) + ("sliding_attention",) * 3 and cfg.sliding_window == 8
    assert (cfg.rope_local_theta, cfg.no_rope_layers, cfg.attention_sinks) == (5000.0, (0, 1, 1, 1), True)
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.logits_scaling) == (2.0, 0.5, 3.0)
    assert params.layers.sinks.shape == (4, 4)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    with pytest.raises(UnsupportedModelError, match="layer_rope_theta"):
        ModelConfig.from_hf({**cfg.to_hf(), "layer_rope_theta": [0, 5000.0, 7000.0, 5000.0]})


def test_granite_swa_logits_match_transformers(tiny):
    """Transformers' logits; without the sinks, the window, or with the windowed layers turned by the full layers'
    base, they are not."""
    _, model, cfg, params = tiny
    sinkless = dataclasses.replace(params, layers=dataclasses.replace(params.layers, sinks=params.layers.sinks - 1e9))
    assert_logits_match(model, cfg, params, dict(sliding_window=None), dict(rope_local_theta=None))
    ids = random_prompt()
    assert rel_err(prompt_logits(cfg, sinkless, ids), hf_logits(model, ids)) > 1e-3


def test_granite_swa_checkpoint_written_back_reads_the_same(tiny):
    path, _, cfg, params = tiny
    assert_written_back(path, cfg, params)


def test_granite_swa_engine_greedy_equals_transformers(tiny):
    """Prompts of 21 and 13 tokens prefilled 16 tokens a step (past the 8-key window), then decoded together."""
    _, model, cfg, params = tiny
    assert_engine_greedy(model, cfg, params, "scan")


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return tiny_loaded(tmp_path_factory, "GraniteMoeSWAConfig", "granitemoe_swa", **TINY, num_local_experts=4,
                       num_experts_per_tok=2, intermediate_size=32, shared_intermediate_size=48)


def test_granitemoe_swa_logits_and_checkpoint(tiny_moe):
    """`GraniteMoeSWAForCausalLM`: the same layers with Granite MoE's experts (fused gate and up, softmax over the top
    k logits) and shared MLP: transformers' logits (not them with the top k's weights unrenormalized), the
    checkpoint written back exactly (under transformers' names for the experts and router), the engine's greedy
    tokens."""
    path, model, cfg, params = tiny_moe
    assert (cfg.family, cfg.num_experts, cfg.shared_expert_intermediate_size) == ("granitemoe_swa", 4, 48)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    assert_logits_match(model, cfg, params, dict(norm_topk_prob=False))
    assert_written_back(path, cfg, params)
    assert_engine_greedy(model, cfg, params, "scan")
