"""StableLM 2 and StableLM-3B-4E1T (`StableLmForCausalLM`) against transformers: a tiny random model with Llama's
layers under LayerNorms with biases, a quarter of each head rotated, and q, k and v biased (`use_qkv_bias`; the
output projection and the MLP not). Logits (and not them without the norms' biases), greedy tokens through the
engine, the checkpoint and config written back; StableLM 2 12B's per-head q/k norms and parallel blocks refused by
name."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from jaxserve.config import ModelConfig  # noqa: E402
from jaxserve.errors import UnsupportedModelError  # noqa: E402
from tests.modelrun import prompt_logits  # noqa: E402
from tests.test_gguf_families import STABLELM  # noqa: E402
from tests.test_model_families import (  # noqa: E402
    assert_engine_greedy,
    assert_logits_match,
    assert_written_back,
    rel_err,
    tiny_loaded,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_loaded(tmp_path_factory, "StableLmConfig", "stablelm", **STABLELM)


def test_stablelm_config(tiny):
    _, _, cfg, params = tiny
    assert (cfg.family, cfg.hidden_act, cfg.gated_mlp, cfg.parallel_block, cfg.rotary_dims, cfg.head_dim) == (
        "stablelm", "silu", True, False, 4, 16)
    assert (cfg.attention_bias, cfg.output_bias, cfg.mlp_bias, cfg.norm_bias) == (True, False, False, True)
    assert params.layers.bq is not None and params.layers.bo is None and params.layers.mlp_norm_b is not None
    hf = cfg.to_hf()
    assert (hf["model_type"], hf["use_qkv_bias"], hf["partial_rotary_factor"]) == ("stablelm", True, 0.25)
    assert ModelConfig.from_hf(hf) == cfg and not ModelConfig.from_hf({**hf, "use_qkv_bias": False}).attention_bias
    for key in ("qk_layernorm", "use_parallel_residual"):
        with pytest.raises(UnsupportedModelError, match=f"StableLM with {key} is not supported"):
            ModelConfig.from_hf({**hf, key: True})


def test_stablelm_logits_match_transformers(tiny):
    """Transformers' logits; without the norms' biases they are not."""
    _, model, cfg, params = tiny
    ids, ref = assert_logits_match(model, cfg, params)
    layers = dataclasses.replace(params.layers, attn_norm_b=None, mlp_norm_b=None)
    assert rel_err(prompt_logits(cfg, dataclasses.replace(params, layers=layers), ids), ref) > 1e-3


def test_stablelm_checkpoint_written_back_and_engine_greedy(tiny):
    path, model, cfg, params = tiny
    assert_written_back(path, cfg, params)
    assert_engine_greedy(model, cfg, params, "scan")
