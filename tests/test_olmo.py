"""OLMo (`OlmoForCausalLM`: OLMo-1B, OLMo-7B, OLMo-1.7) against transformers: a tiny random model with Llama's
layers under LayerNorms without weights or biases (held as ones, in no checkpoint), and q, k and v clamped after
their projections (`clip_qkv`, small enough here to bind). Logits (and not them unclamped), greedy tokens through the
engine, the checkpoint and config written back, and llama.cpp's "olmo" files (q and k rows in its rotary order, no
norm tensors, the clamp as `attention.clamp_kqv`). OLMoE's clamp, after its q and k norms."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from jaxserve.config import ModelConfig  # noqa: E402
from tests.test_gguf_models import _llama_cpp_permute, assert_gguf_equals_hf, shaped_writer  # noqa: E402
from tests.test_model_families import (  # noqa: E402
    assert_engine_greedy,
    assert_logits_match,
    assert_written_back,
    tiny_loaded,
)

GGUF_NAMES = {"embed_tokens": "token_embd", "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v",
              "o_proj": "attn_output", "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
              "lm_head": "output"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_loaded(tmp_path_factory, "OlmoConfig", "olmo", clip_qkv=0.5, pad_token_id=0, bos_token_id=1,
                       eos_token_id=2)


def test_olmo_config_logits_and_checkpoint(tiny):
    """Its config (eps 1e-5, the clamp) and norms of ones; transformers' logits, and not them unclamped; the
    checkpoint written back holds no norm weights, as the file."""
    path, model, cfg, params = tiny
    assert (cfg.family, cfg.clip_qkv, cfg.rms_norm_eps, cfg.norm_bias) == ("olmo", 0.5, 1e-5, False)
    assert (np.asarray(params.layers.attn_norm) == 1).all() and (np.asarray(params.final_norm) == 1).all()
    hf = cfg.to_hf()
    assert (hf["model_type"], hf["clip_qkv"]) == ("olmo", 0.5) and "rms_norm_eps" not in hf
    assert ModelConfig.from_hf(hf) == cfg and ModelConfig.from_hf({**hf, "clip_qkv": None}).clip_qkv is None
    assert_logits_match(model, cfg, params, {"clip_qkv": None})
    assert_written_back(path, cfg, params)


def test_olmo_engine_greedy_equals_transformers(tiny):
    _, model, cfg, params = tiny
    assert_engine_greedy(model, cfg, params, "scan")


def test_olmo_gguf_equals_the_hf_model(tiny, tmp_path):
    from safetensors.numpy import load_file

    path, model, cfg, _ = tiny
    c = model.config
    w = shaped_writer(tmp_path / "olmo.gguf", "olmo", c)
    w.add_layer_norm_eps(1e-5)
    w.add_clamp_kqv(c.clip_qkv)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    for name, a in load_file(path / "model.safetensors").items():
        parts = name.split(".")
        if parts[-2] in ("q_proj", "k_proj"):  # (as llama.cpp's converter permutes them)
            a = _llama_cpp_permute(a, c.num_attention_heads if parts[-2] == "q_proj" else c.num_key_value_heads)
        block = f"blk.{parts[2]}." if parts[1] == "layers" else ""
        w.add_tensor(f"{block}{GGUF_NAMES[parts[-2] if len(parts) > 2 else parts[0]]}.{parts[-1]}", a)
    assert_gguf_equals_hf(w, tmp_path / "olmo.gguf", cfg, model)


def test_olmoe_clamps_after_its_q_and_k_norms(tmp_path_factory):
    """OLMoE's `clip_qkv` (refused before): q and k clamped after their norms over all heads, v after its projection;
    transformers' logits (not them unclamped, nor clamped before the norms), written back."""
    from jaxserve.models import ops
    from tests.test_moe import MOE

    path, model, cfg, params = tiny_loaded(tmp_path_factory, "OlmoeConfig", "olmoe", **MOE, num_experts=8,
                                           intermediate_size=32, norm_topk_prob=False, clip_qkv=0.5, pad_token_id=0,
                                           bos_token_id=1, eos_token_id=2)
    assert (cfg.family, cfg.clip_qkv, cfg.to_hf()["clip_qkv"]) == ("olmoe", 0.5, 0.5)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    ids, ref = assert_logits_match(model, cfg, params, {"clip_qkv": None})
    assert_written_back(path, cfg, params)

    def before(c, q, k, v, normed):  # (as OLMo's: before the norms)
        return ops.clip_qkv(dataclasses.replace(c, family="olmo"), q, k, v, normed)

    with pytest.MonkeyPatch.context() as mp:
        from tests.modelrun import prompt_logits
        from tests.test_model_families import rel_err

        mp.setattr("jaxserve.models.llama.clip_qkv", before)
        other = dataclasses.replace(cfg, max_position_embeddings=cfg.max_position_embeddings + 1)  # (traced anew)
        assert rel_err(prompt_logits(other, params, ids), ref) > 1e-3
