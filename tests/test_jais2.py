"""Jais 2 (`Jais2ForCausalLM`) against transformers: a tiny random model with Llama's biased attention, LayerNorms
with biases before attention, before the MLP and at the end, and an ungated squared-ReLU MLP with biases. Logits of a
40-token prompt (and not them without the norms' biases), greedy tokens through the engine (chunked prefill, batched
decode, layers unrolled and stacked), the checkpoint and config written back."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from jaxserve.config import ModelConfig  # noqa: E402
from tests.modelrun import prompt_logits  # noqa: E402
from tests.test_model_families import (  # noqa: E402
    assert_engine_greedy,
    assert_logits_match,
    assert_written_back,
    rel_err,
    tiny_loaded,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_loaded(tmp_path_factory, "Jais2Config", "jais2", head_dim=16, bos_token_id=1, eos_token_id=2)


def test_jais2_config(tiny):
    _, _, cfg, params = tiny
    assert (cfg.family, cfg.hidden_act, cfg.gated_mlp, cfg.attention_bias, cfg.output_bias, cfg.mlp_bias) == (
        "jais2", "relu2", False, True, True, True)
    assert cfg.norm_bias and params.final_norm_b.shape == (cfg.hidden_size,)
    assert params.layers.attn_norm_b.shape == params.layers.mlp_norm_b.shape == (cfg.num_layers, cfg.hidden_size)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


def test_jais2_logits_match_transformers(tiny):
    """Transformers' logits; with any of the norms' biases left out, they are not."""
    _, model, cfg, params = tiny
    ids, ref = assert_logits_match(model, cfg, params)
    for drop in ({"final_norm_b": None}, {"layers": dataclasses.replace(params.layers, attn_norm_b=None)},
                 {"layers": dataclasses.replace(params.layers, mlp_norm_b=None)}):
        assert rel_err(prompt_logits(cfg, dataclasses.replace(params, **drop), ids), ref) > 1e-3, drop


def test_jais2_checkpoint_written_back_reads_the_same(tiny):
    path, _, cfg, params = tiny
    assert_written_back(path, cfg, params)


@pytest.mark.parametrize("loop", ["unroll", "scan"])
def test_jais2_engine_greedy_equals_transformers(tiny, loop):
    _, model, cfg, params = tiny
    assert params.layers.mlp_norm_b.dtype == jnp.float32
    assert_engine_greedy(model, cfg, params, loop)
