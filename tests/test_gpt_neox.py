"""GPT-NeoX (`GPTNeoXForCausalLM`: Pythia, GPT-NeoX-20B, Dolly v2) against transformers: a tiny random model with
attention and an ungated exact-GELU MLP side by side, each on its own LayerNorm with a bias, a quarter of each head
rotated, q, k and v in one `query_key_value` laid out per head, every projection biased and the head untied
(`embed_out`). Logits (and not them with every dim rotated), greedy tokens through the engine, the checkpoint and
config written back under its names, llama.cpp's "gptneox" files (q, k and v one after another); and its sequential
form (`use_parallel_residual` false: the MLP after attention, on the residual), likewise."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from jaxserve.config import ModelConfig  # noqa: E402
from jaxserve.models.ops import mlp_activation  # noqa: E402
from tests.test_gguf_models import assert_gguf_equals_hf, shaped_writer  # noqa: E402
from tests.test_model_families import (  # noqa: E402
    assert_engine_greedy,
    assert_logits_match,
    assert_written_back,
    tiny_loaded,
)

GGUF_NAMES = {"embed_in": "token_embd", "final_layer_norm": "output_norm", "input_layernorm": "attn_norm",
              "post_attention_layernorm": "ffn_norm", "query_key_value": "attn_qkv", "dense": "attn_output",
              "dense_h_to_4h": "ffn_up", "dense_4h_to_h": "ffn_down", "embed_out": "output"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_loaded(tmp_path_factory, "GPTNeoXConfig", "gpt_neox", bos_token_id=1, eos_token_id=2)


def test_gpt_neox_config_logits_and_checkpoint(tiny):
    path, model, cfg, params = tiny
    assert (cfg.family, cfg.num_kv_heads, cfg.hidden_act, cfg.rotary_dims, cfg.parallel_block) == (
        "gpt_neox", 4, "gelu", 4, True)
    assert params.layers.mlp_norm is not None and params.layers.mlp_norm_b is not None  # (its own, beside attention)
    hf = cfg.to_hf()
    assert (hf["model_type"], hf["rotary_pct"], hf["use_parallel_residual"]) == ("gpt_neox", 0.25, True)
    assert ModelConfig.from_hf(hf) == cfg
    x = jnp.linspace(-3.0, 3.0, 61)  # (its GELU the exact one, not the tanh form)
    exact = mlp_activation(cfg, None, x, None)
    assert np.abs(np.asarray(exact - mlp_activation(dataclasses.replace(cfg, hidden_act="gelu_pytorch_tanh"), None, x,
                                                    None))).max() > 1e-4
    assert_logits_match(model, cfg, params, {"rotary_dim": None})
    assert_written_back(path, cfg, params)  # (`query_key_value` per head, `embed_out`: exactly)


def test_gpt_neox_engine_greedy_equals_transformers(tiny):
    _, model, cfg, params = tiny
    assert_engine_greedy(model, cfg, params, "scan")


def test_sequential_gpt_neox_logits_engine_and_checkpoint(tmp_path_factory):
    """`use_parallel_residual` false: attention, then the MLP on its own norm of the residual after it (and not the
    parallel form's logits with its weights)."""
    path, model, cfg, params = tiny_loaded(tmp_path_factory, "GPTNeoXConfig", "gpt_neox_seq", bos_token_id=1,
                                           eos_token_id=2, use_parallel_residual=False)
    assert (cfg.family, cfg.parallel_residual, cfg.parallel_block) == ("gpt_neox", False, False)
    hf = cfg.to_hf()
    assert hf["use_parallel_residual"] is False and ModelConfig.from_hf(hf) == cfg
    assert_logits_match(model, cfg, params, {"parallel_residual": None})
    assert_written_back(path, cfg, params)
    assert_engine_greedy(model, cfg, params, "unroll")


def test_gptneox_gguf_equals_the_hf_model(tiny, tmp_path):
    from safetensors.numpy import load_file

    path, model, cfg, _ = tiny
    c = model.config
    w = shaped_writer(tmp_path / "neox.gguf", "gptneox", c)
    w.add_rope_dimension_count(cfg.rotary_dims)
    w.add_parallel_residual(True)
    w.add_layer_norm_eps(c.layer_norm_eps)
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    for name, a in load_file(path / "model.safetensors").items():
        parts = name.split(".")
        if parts[-2] == "query_key_value":  # (as llama.cpp's converter reorders it: all q, all k, all v)
            a = a.reshape(c.num_attention_heads, 3, -1, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape)
        block = f"blk.{parts[2]}." if parts[1] == "layers" else ""
        w.add_tensor(f"{block}{GGUF_NAMES[parts[-2] if parts[0] != 'embed_out' else 'embed_out']}.{parts[-1]}", a)
    assert_gguf_equals_hf(w, tmp_path / "neox.gguf", cfg, model)
