"""Cohere's Command A MoE layers (`Cohere2MoeForCausalLM`, `config_cohere2_moe`) against transformers: a tiny random
model with a dense first layer (its own width, global and still rotated), then five MoE layers of which the fourth is
global and unrotated and the others windowed (8 keys); attention and the MLP side by side on one LayerNormed input;
experts weighted by the softmax of their top-2 logits, averaged with a shared expert (and, in a second model, by
their renormalized sigmoids, a shared expert added). Logits of a 40-token prompt (and not them without each feature),
greedy tokens through the engine, the checkpoint and config written back, the forms not read refused by name."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from jaxserve.config import ModelConfig  # noqa: E402
from jaxserve.errors import UnsupportedModelError  # noqa: E402
from tests.test_model_families import (  # noqa: E402
    assert_engine_greedy,
    assert_logits_match,
    assert_written_back,
    tiny_loaded,
)

TINY = dict(num_hidden_layers=6, head_dim=16, num_experts=8, num_experts_per_tok=2, intermediate_size=24,
            num_shared_experts=1, first_k_dense_replace=1, prefix_dense_intermediate_size=40, sliding_window=8,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_loaded(tmp_path_factory, "Cohere2MoeConfig", "cohere2_moe", **TINY)


def test_cohere2_moe_config(tiny):
    _, _, cfg, _ = tiny
    assert (cfg.family, cfg.first_dense_layers, cfg.intermediate_size, cfg.moe_intermediate_size) == (
        "cohere2_moe", 1, 40, 24)
    assert cfg.layer_types == ("full_attention",) + ("sliding_attention",) * 3 + ("full_attention", "sliding_attention")
    assert cfg.no_rope_layers == (1, 1, 1, 1, 0, 1) and cfg.parallel_block and cfg.tie_word_embeddings
    assert (cfg.layer_period, cfg.period_from(1)) == (6, 4)  # (the stacked MoE layers loop in groups of 4)
    assert (cfg.shared_expert_intermediate_size, cfg.routed_scaling_factor, cfg.shared_expert_scale) == (24, 0.5, 0.5)
    assert (cfg.router_scoring, cfg.norm_topk_prob) == ("softmax", True)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    hf = cfg.to_hf()
    for bad, match in ((dict(rms_norm_eps=1e-5), "rms_norm_eps"), (dict(expert_selection_fn="relu"), "relu"),
                       (dict(mlp_layer_types=["sparse", "dense"] + ["sparse"] * 4), "mlp_layer_types")):
        with pytest.raises(UnsupportedModelError, match=match):
            ModelConfig.from_hf({**hf, **bad})


def test_cohere2_moe_logits_match_transformers(tiny):
    """Transformers' logits; with the shared expert added rather than averaged, the dense layer unrotated, or no
    window, they are not."""
    _, model, cfg, params = tiny
    assert_logits_match(model, cfg, params, dict(routed_scaling_factor=1.0, shared_expert_scale=1.0),
                        dict(no_rope_layers=(0,) + cfg.no_rope_layers[1:]), dict(sliding_window=None))


def test_cohere2_moe_sigmoid_scores_and_a_shared_expert_added(tmp_path_factory):
    _, model, cfg, params = tiny_loaded(tmp_path_factory, "Cohere2MoeConfig", "cohere2_moe_sigmoid", **TINY,
                                        expert_selection_fn="sigmoid", shared_expert_combination_strategy="sum")
    assert (cfg.router_scoring, cfg.routed_scaling_factor, cfg.shared_expert_scale) == ("sigmoid", 1.0, 1.0)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    assert_logits_match(model, cfg, params, dict(norm_topk_prob=False))


def test_cohere2_moe_checkpoint_written_back_reads_the_same(tiny):
    path, _, cfg, params = tiny
    assert_written_back(path, cfg, params)


def test_cohere2_moe_engine_greedy_equals_transformers(tiny):
    """Prompts of 21 and 13 tokens prefilled 16 tokens a step (past the 8-key window), then decoded together, the
    layers stacked."""
    _, model, cfg, params = tiny
    assert_engine_greedy(model, cfg, params, "scan")
