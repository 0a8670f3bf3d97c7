"""BLOOM (`BloomForCausalLM`: BLOOM 560M to 176B, BLOOMZ) against transformers, a tiny random model: a LayerNorm of the
embeddings, sequential blocks of LayerNorms with biases, q, k and v per head in `query_key_value`, biased projections,
a tanh-GELU MLP, ALiBi with BLOOM's slopes (six heads: four of the power of two, two of the next); logits on both
backends, config and checkpoint written back under its names, greedy tokens through the engine, llama.cpp's `bloom`
files, and the form transformers' BLOOM does not take refused by name."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxserve.config import ModelConfig  # noqa: E402
from jaxserve.config_gpt2 import alibi_slopes  # noqa: E402
from jaxserve.errors import UnsupportedModelError  # noqa: E402
from tests.test_gguf_models import assert_gguf_equals_hf, shaped_writer  # noqa: E402
from tests.test_model_families import (  # noqa: E402
    assert_engine_greedy,
    assert_logits_match,
    assert_written_back,
    tiny_loaded,
)

BLOOM = dict(hidden_size=96, num_attention_heads=6, bos_token_id=1, eos_token_id=2)
GGUF_NAMES = {"word_embeddings": "token_embd", "word_embeddings_layernorm": "token_embd_norm", "ln_f": "output_norm",
              "input_layernorm": "attn_norm", "query_key_value": "attn_qkv", "dense": "attn_output",
              "post_attention_layernorm": "ffn_norm", "dense_h_to_4h": "ffn_up", "dense_4h_to_h": "ffn_down"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_loaded(tmp_path_factory, "BloomConfig", "bloom", **BLOOM)


def test_bloom_slopes():
    assert alibi_slopes(8) == tuple(2.0 ** -i for i in range(1, 9))
    assert alibi_slopes(6) == (2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3)


def test_bloom_logits_config_and_checkpoint(tiny):
    path, model, cfg, params = tiny
    assert (cfg.family, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.hidden_act) == (
        "bloom", 6, 6, 384, "gelu_pytorch_tanh")
    assert (cfg.attention_bias, cfg.mlp_bias, cfg.tie_word_embeddings, cfg.parallel_block) == (True, True, True, False)
    assert cfg.alibi_slopes == alibi_slopes(6) and params.embed_norm is not None and params.embed_norm_b is not None
    hf = cfg.to_hf()
    assert ModelConfig.from_hf(hf) == cfg
    theirs = transformers.BloomConfig(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})
    assert (theirs.hidden_size, theirs.n_head, theirs.n_layer) == (96, 6, 2)
    # (without the slopes, or without the embeddings' norm, they are not it)
    no_norm = dataclasses.replace(params, embed_norm=None, embed_norm_b=None)
    ids, ref = assert_logits_match(model, cfg, params, {"alibi_slopes": None}, backends=("xla", "pallas_interpret"))
    from tests.test_model_families import prompt_logits, rel_err

    assert rel_err(prompt_logits(cfg, no_norm, ids), ref) > 1e-3
    assert_written_back(path, cfg, params)  # (query_key_value per head, the embeddings' norm: exactly)


def test_bloom_engine_greedy_equals_transformers(tiny):
    _, model, cfg, params = tiny
    assert_engine_greedy(model, cfg, params, "scan")


def test_bloom_gguf_equals_the_hf_model(tiny, tmp_path):
    """As llama.cpp's converter writes BLOOM: `attn_qkv` reordered to q, k and v one after another, the embeddings'
    norm `token_embd_norm`, the head tied."""
    from safetensors.numpy import load_file

    path, model, cfg, _ = tiny
    c = model.config
    w = shaped_writer(tmp_path / "bloom.gguf", "bloom", _Shape(c))
    w.add_layer_norm_eps(c.layer_norm_epsilon)
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    d = c.hidden_size // c.n_head
    for name, a in load_file(path / "model.safetensors").items():
        parts = name.split(".")
        if parts[-2] == "query_key_value":  # (as the converter reorders it)
            heads = a.reshape(c.n_head, 3, d, *a.shape[1:])
            a = np.concatenate([heads[:, i].reshape(-1, *a.shape[1:]) for i in range(3)])
        block = f"blk.{parts[2]}." if parts[1] == "h" else ""
        w.add_tensor(f"{block}{GGUF_NAMES[parts[-2]]}.{parts[-1]}", a)
    assert_gguf_equals_hf(w, tmp_path / "bloom.gguf", cfg, model)


class _Shape:
    """BLOOM's config as `shaped_writer` reads a shape (its MLP 4x wide, a KV head per head)."""

    def __init__(self, c):
        self.hidden_size, self.num_attention_heads, self.num_key_value_heads = c.hidden_size, c.n_head, c.n_head
        self.intermediate_size, self.num_hidden_layers, self.max_position_embeddings = 4 * c.hidden_size, c.n_layer, 2048


def test_bloom_post_layernorm_residual_is_refused_by_name():
    d = {"architectures": ["BloomForCausalLM"], "model_type": "bloom", "vocab_size": 160, "n_embed": 64, "n_head": 4,
         "n_layer": 2}
    ModelConfig.from_hf(d)
    with pytest.raises(UnsupportedModelError, match="apply_residual_connection_post_layernorm"):
        ModelConfig.from_hf({**d, "apply_residual_connection_post_layernorm": True})
