"""Xiaomi's MiMo-V2-Flash (`MiMoV2FlashForCausalLM`, `config_mimo`, `loader.mimo_keys`) against transformers: a tiny
random model with a dense first layer (full attention, one KV head) and three MoE layers windowed at 8 keys (two KV
heads and attention sinks each, their own rotary base), queries and keys 48 wide and values 32 (padded to 48 when
held), a third of each head rotated, values scaled by 0.707. Logits of a 40-token prompt, in XLA and on the Pallas
kernel (interpreted; its heads read as 32 + 16 dims, as 192 = 128 + 64), and not them without the window, the sinks,
the value scale or the windowed layers' rotary base; greedy tokens through the engine (chunked prefill past the
window, batched decode), the checkpoint and config written back."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from jaxserve.config import ModelConfig, UnsupportedModelError  # noqa: E402
from tests.modelrun import prompt_logits  # noqa: E402
from tests.test_model_families import (  # noqa: E402
    assert_engine_greedy,
    assert_logits_match,
    assert_written_back,
    rel_err,
    tiny_loaded,
)

TINY = dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=48, v_head_dim=32,
            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, n_group=2, topk_group=1,
            sliding_window=8, rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 50000.0, "partial_rotary_factor": 0.334},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.334}})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_loaded(tmp_path_factory, "MiMoV2FlashConfig", "mimo", **TINY)


def test_mimo_config_and_uniform_layers(tiny):
    _, _, cfg, params = tiny
    assert (cfg.family, cfg.num_kv_heads, cfg.head_dim, cfg.attention_value_dim, cfg.rotary_dims) == (
        "mimo_v2_flash", 2, 48, 32, 16)
    assert cfg.layer_types == ("full_attention",) + ("sliding_attention",) * 3 and cfg.sliding_window == 8
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.attention_value_scale) == (50000.0, 100.0, 0.707)
    assert (cfg.first_dense_layers, cfg.router_scoring, cfg.expert_groups, cfg.shared_expert_intermediate_size) == (
        1, "sigmoid", 2, 0)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    # The full layer: its one KV head held twice, no sinks; values padded with zeros, the output's extra rows zero.
    wk = np.asarray(params.dense_layers.wk[0])  # [E, 2, 48]
    np.testing.assert_array_equal(wk[:, 0], wk[:, 1])
    assert np.isneginf(np.asarray(params.dense_layers.sinks)).all() and np.isfinite(np.asarray(params.layers.sinks)).all()
    assert not np.asarray(params.layers.wv)[..., 32:].any() and not np.asarray(params.layers.wo)[:, :, 32:].any()


def test_mimo_logits_match_transformers(tiny):
    """Transformers' logits; without the window, the sinks, the value scale or the windowed layers' own rotary base,
    they are not."""
    _, model, cfg, params = tiny
    ids, ref = assert_logits_match(model, cfg, params, dict(sliding_window=None), dict(attention_value_scale=1.0),
                                   dict(rope_local_theta=None), backends=("xla", "pallas_interpret"))
    no_sinks = dataclasses.replace(params, layers=dataclasses.replace(
        params.layers, sinks=jnp.full_like(params.layers.sinks, -jnp.inf)))
    assert rel_err(prompt_logits(cfg, no_sinks, ids), ref) > 1e-3


def test_mimo_checkpoint_written_back_reads_the_same(tiny):
    path, _, cfg, params = tiny
    assert_written_back(path, cfg, params)


def test_mimo_engine_greedy_equals_transformers(tiny):
    """Prompts of 21 and 13 tokens prefilled 16 tokens a step (past the 8-key window), then decoded together, the
    layers stacked (the dense full layer, then the windowed MoE layers)."""
    _, model, cfg, params = tiny
    assert_engine_greedy(model, cfg, params, "scan")


def test_mimo_released_config_form_reads_as_transformers_form(tiny):
    """The released checkpoints' config keys (`hybrid_layer_pattern`, `moe_layer_freq`, `swa_*`, a window of the keys
    before the query) give the same config; forms jaxserve does not serve are refused by name."""
    _, _, cfg, _ = tiny
    hub = {k: v for k, v in cfg.to_hf().items() if k not in ("layer_types", "mlp_layer_types", "rope_parameters")}
    hub.update(hybrid_layer_pattern=[0, 1, 1, 1], moe_layer_freq=[0, 1, 1, 1], sliding_window_size=7,
               swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=48, swa_v_head_dim=32,
               rope_theta=50000.0, swa_rope_theta=100.0, partial_rotary_factor=0.334, add_swa_attention_sink_bias=True,
               add_full_attention_sink_bias=False, layernorm_epsilon=cfg.rms_norm_eps)
    del hub["sliding_window"]
    assert ModelConfig.from_hf(hub) == cfg
    for key, value in (("swa_num_key_value_heads", 3), ("add_full_attention_sink_bias", True), ("swa_head_dim", 64)):
        with pytest.raises(UnsupportedModelError, match=key):
            ModelConfig.from_hf({**hub, key: value})
    # transformers' form without rope_parameters: its defaults (bases 5e6 and 1e4, a third of each head rotated)
    bare = ModelConfig.from_hf({k: v for k, v in cfg.to_hf().items() if k != "rope_parameters"})
    assert (bare.rope_theta, bare.rope_local_theta, bare.rotary_dims) == (5e6, 1e4, 16)
