"""Nemotron-4 and Minitron (`NemotronForCausalLM`) against transformers: a tiny random model with LayerNorms whose
weights scale by (1 + w) beside their biases, half of each head rotated, an ungated squared-ReLU MLP, and (here)
every projection biased. Logits (and not them with the norms scaled by w), greedy tokens through the engine, the
checkpoint and config written back."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from jaxserve.config import ModelConfig  # noqa: E402
from tests.modelrun import prompt_logits  # noqa: E402
from tests.test_gguf_families import NEMOTRON  # noqa: E402
from tests.test_model_families import (  # noqa: E402
    assert_engine_greedy,
    assert_logits_match,
    assert_written_back,
    rel_err,
    tiny_loaded,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_loaded(tmp_path_factory, "NemotronConfig", "nemotron", **NEMOTRON)


def test_nemotron_config(tiny):
    _, _, cfg, params = tiny
    assert (cfg.family, cfg.hidden_act, cfg.gated_mlp, cfg.rotary_dims, cfg.head_dim) == (
        "nemotron", "relu2", False, 8, 16)
    assert (cfg.attention_bias, cfg.output_bias, cfg.mlp_bias, cfg.norm_bias) == (True,) * 4
    hf = cfg.to_hf()
    assert (hf["model_type"], hf["norm_eps"], hf["partial_rotary_factor"]) == ("nemotron", 1e-5, 0.5)
    assert ModelConfig.from_hf(hf) == cfg
    plain = {k: v for k, v in hf.items() if k not in ("attention_bias", "mlp_bias", "partial_rotary_factor")}
    assert ModelConfig.from_hf(plain) == dataclasses.replace(cfg, attention_bias=False, mlp_bias=False)


def test_nemotron_logits_match_transformers(tiny):
    """Transformers' logits; with the norms' weights taken as they are (not 1 + w), they are not."""
    _, model, cfg, params = tiny
    ids, ref = assert_logits_match(model, cfg, params)
    as_w = {"final_norm": params.final_norm - 1.0, "layers": dataclasses.replace(
        params.layers, attn_norm=params.layers.attn_norm - 1.0, mlp_norm=params.layers.mlp_norm - 1.0)}  # (1 + w - 1)
    assert rel_err(prompt_logits(cfg, dataclasses.replace(params, **as_w), ids), ref) > 1e-3


def test_nemotron_checkpoint_written_back_and_engine_greedy(tiny):
    path, model, cfg, params = tiny
    assert_written_back(path, cfg, params)
    assert_engine_greedy(model, cfg, params, "scan")
