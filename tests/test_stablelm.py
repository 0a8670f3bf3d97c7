"""StableLM 2 and StableLM-3B-4E1T (`StableLmForCausalLM`) against transformers: a tiny random model with Llama's
layers under LayerNorms with biases, a quarter of each head rotated, and q, k and v biased (`use_qkv_bias`; the
output projection and the MLP not). Logits (and not them without the norms' biases), greedy tokens through the
engine, the checkpoint and config written back; and StableLM 2 12B's form: q and k each head normed by its own
LayerNorm, attention and the MLP side by side."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from jaxserve.config import ModelConfig  # noqa: E402
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


def test_stablelm_2_12b_per_head_norms_and_parallel_blocks(tmp_path_factory):
    """StableLM 2 12B (`qk_layernorm`, `use_parallel_residual`): each head's q and k LayerNormed by its own weight (a
    tensor a head), attention and the MLP side by side on the one input norm. Transformers' logits, and not them with
    the first head's norm for all or the MLP after attention; the checkpoint written back; greedy tokens through the
    engine."""
    import jax.numpy as jnp

    path, model, cfg, params = tiny_loaded(tmp_path_factory, "StableLmConfig", "stablelm_12b", **STABLELM,
                                           qk_layernorm=True, use_parallel_residual=True)
    assert (cfg.qk_norm, cfg.parallel_block, params.layers.mlp_norm) == (True, True, None)
    assert params.layers.q_norm.shape[1:] == (cfg.num_heads, cfg.head_dim)
    hf = cfg.to_hf()
    assert hf["qk_layernorm"] is True and hf["use_parallel_residual"] is True and ModelConfig.from_hf(hf) == cfg
    ids, ref = assert_logits_match(model, cfg, params, {"parallel_residual": None})
    one = {k: jnp.broadcast_to(getattr(params.layers, k)[:, :1], getattr(params.layers, k).shape)
           for k in ("q_norm", "k_norm")}
    assert rel_err(prompt_logits(cfg, dataclasses.replace(params, layers=dataclasses.replace(params.layers, **one)),
                                 ids), ref) > 1e-3
    assert_written_back(path, cfg, params)
    assert_engine_greedy(model, cfg, params, "scan")


def test_stablelm_2_12b_gguf_refused_by_its_tensors():
    """llama.cpp's StableLM 2 12B files (per-head q/k norms as `attn_q_norm`, no `ffn_norm` in parallel blocks) are
    refused by name; the other StableLM files read."""
    from jaxserve.errors import UnsupportedModelError
    from jaxserve.loader.gguf_config import config_from_gguf

    meta = {"general.architecture": "stablelm", "stablelm.context_length": 512, "stablelm.embedding_length": 64,
            "stablelm.block_count": 2, "stablelm.feed_forward_length": 128, "stablelm.attention.head_count": 4,
            "stablelm.attention.head_count_kv": 4, "stablelm.attention.layer_norm_epsilon": 1e-5,
            "stablelm.rope.dimension_count": 4}
    names = {"blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "blk.0.attn_q.bias"}
    cfg = config_from_gguf(meta, 64, True, tensor_names=frozenset(names))
    assert (cfg.family, cfg.qk_norm, cfg.parallel_block, cfg.rotary_dims) == ("stablelm", False, False, 4)
    for bad in (names | {"blk.0.attn_q_norm.weight"}, names - {"blk.0.ffn_norm.weight"}):
        with pytest.raises(UnsupportedModelError, match="StableLM GGUF files with q/k norms or parallel blocks"):
            config_from_gguf(meta, 64, True, tensor_names=frozenset(bad))
