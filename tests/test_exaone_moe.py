"""LG's K-EXAONE (`ExaoneMoeForCausalLM`, `config_exaone_moe`) against transformers: a tiny random model with a dense
first layer, then four MoE layers of which three are windowed (8 keys) and the fourth global and unrotated, so the dense
layer and the MoE ones attend differently; logits of a 40-token prompt, greedy tokens through the engine (chunked
prefill past the window, batched decode), the checkpoint and config written back."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from jaxserve.config import ModelConfig  # noqa: E402
from tests.test_model_families import (  # noqa: E402
    assert_engine_greedy,
    assert_logits_match,
    assert_written_back,
    tiny_loaded,
)

TINY = dict(num_hidden_layers=5, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
            num_shared_experts=1, n_group=2, topk_group=1, sliding_window=8, sliding_window_pattern=4,
            first_k_dense_replace=1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_loaded(tmp_path_factory, "ExaoneMoeConfig", "exaone_moe", **TINY)


def test_exaone_moe_config(tiny):
    _, _, cfg, _ = tiny
    assert (cfg.family, cfg.first_dense_layers, cfg.qk_norm, cfg.router_scoring, cfg.router_bias) == (
        "exaone_moe", 1, True, "sigmoid", True)
    assert cfg.layer_types == ("sliding_attention",) * 3 + ("full_attention", "sliding_attention")
    assert cfg.no_rope_layers == (1, 1, 1, 0, 1) and cfg.layer_period == 4
    assert (cfg.shared_expert_intermediate_size, cfg.expert_groups, cfg.routed_scaling_factor) == (24, 2, 2.5)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


def test_exaone_moe_logits_match_transformers(tiny):
    """Transformers' logits; without the window, or with the global layer rotated, they are not."""
    _, model, cfg, params = tiny
    assert_logits_match(model, cfg, params, dict(sliding_window=None), dict(no_rope_layers=None))


def test_exaone_moe_checkpoint_written_back_reads_the_same(tiny):
    path, _, cfg, params = tiny
    assert_written_back(path, cfg, params)


def test_exaone_moe_engine_greedy_equals_transformers(tiny):
    """Prompts of 21 and 13 tokens prefilled 16 tokens a step (past the 8-key window), then decoded together, the
    layers stacked (the dense layer, then the MoE stack in groups of four)."""
    _, model, cfg, params = tiny
    assert_engine_greedy(model, cfg, params, "scan")
