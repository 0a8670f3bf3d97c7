"""Tencent's Hunyuan (`config_hunyuan`) against transformers: tiny random dense and MoE models with q/k norms after the
rotation and an NTK-alpha rotary base; logits of a 40-token prompt (each part checked by the logits it changes), the
MoE model's greedy tokens through the engine, the checkpoints and configs written back."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from jaxserve.config import ModelConfig, UnsupportedModelError  # noqa: E402
from tests.test_model_families import (  # noqa: E402
    assert_engine_greedy,
    assert_logits_match,
    assert_written_back,
    tiny_loaded,
)

ROPE = {"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0}
FAMILIES = {"hunyuan_v1_dense": ("HunYuanDenseV1Config", {}),
            "hunyuan_v1_moe": ("HunYuanMoEV1Config", {"num_experts": 4, "moe_topk": 2})}


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny(request, tmp_path_factory):
    cls, extra = FAMILIES[request.param]
    return request.param, *tiny_loaded(tmp_path_factory, cls, request.param, head_dim=16, rope_parameters=ROPE, **extra)


def test_hunyuan_config(tiny):
    family, _, model, cfg, _ = tiny
    assert (cfg.family, cfg.qk_norm, cfg.rope_qk_norm, cfg.rope_scaling.rope_type) == (family, True, True, "default")
    assert cfg.rope_theta == pytest.approx(10000.0 * 1000.0 ** (16 / 14))
    if family == "hunyuan_v1_moe":
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (4, 2, True)
        assert cfg.moe_intermediate_size == cfg.shared_expert_intermediate_size == cfg.intermediate_size
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    per_layer = {**model.config.to_dict(), "num_experts": [4, 8], "moe_topk": [2, 2]}
    with pytest.raises(UnsupportedModelError, match="num_experts differing by layer"):
        ModelConfig.from_hf(per_layer)
    if family == "hunyuan_v1_moe":
        same = {**model.config.to_dict(), "num_experts": [4, 4], "moe_topk": [2, 2]}
        assert ModelConfig.from_hf(same) == cfg


def test_hunyuan_logits_match_transformers(tiny):
    """Transformers' logits; normed before the rotation, or with the base unstretched, they are not."""
    _, _, model, cfg, params = tiny
    assert_logits_match(model, cfg, params, dict(rope_qk_norm=False), dict(rope_theta=10000.0))


def test_hunyuan_checkpoint_written_back_reads_the_same(tiny):
    """Our parameters as an HF checkpoint (under Hunyuan's own module names) equal the checkpoint's tensors."""
    _, path, _, cfg, params = tiny
    assert_written_back(path, cfg, params)


@pytest.mark.parametrize("tiny", ["hunyuan_v1_moe"], indirect=True)
def test_hunyuan_engine_greedy_equals_transformers(tiny):
    """Prompts of 21 and 13 tokens prefilled 16 tokens a step, then decoded together."""
    _, _, model, cfg, params = tiny
    assert_engine_greedy(model, cfg, params)
