"""MPT (`MptForCausalLM`: MPT-7B, MPT-30B) against transformers, a tiny random model: LayerNorms with weights only, no
biases, an ungated exact-GELU MLP, q, k and v one after another in `Wqkv`, ALiBi with MPT's slopes (six heads: the
slopes of eight, odd steps first); logits on both backends, config and checkpoint written back under its names, greedy
tokens through the engine, `clip_qkv`, and the forms transformers does not run refused by name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxserve.config import ModelConfig  # noqa: E402
from jaxserve.config_gpt2 import mpt_alibi_slopes  # noqa: E402
from jaxserve.errors import UnsupportedModelError  # noqa: E402
from tests.test_gguf_models import assert_gguf_equals_hf, shaped_writer  # noqa: E402
from tests.test_model_families import (  # noqa: E402
    assert_engine_greedy,
    assert_logits_match,
    assert_written_back,
    tiny_loaded,
)

MPT = dict(hidden_size=96, num_attention_heads=6, bos_token_id=1, eos_token_id=2)  # (d_model, n_heads: 96, 6)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_loaded(tmp_path_factory, "MptConfig", "mpt", **MPT)


def test_mpt_slopes_are_mpts():
    assert mpt_alibi_slopes(8) == tuple(2.0 ** -i for i in range(1, 9))
    eight = [2.0 ** -i for i in range(1, 9)]
    assert mpt_alibi_slopes(6) == tuple([*eight[1::2], *eight[::2]][:6])  # (not BLOOM's 2^-(8/4 i), then odd 2^-i)


def test_mpt_logits_config_and_checkpoint(tiny):
    path, model, cfg, params = tiny
    assert (cfg.family, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.hidden_act) == (
        "mpt", 6, 6, 384, "gelu")
    assert (cfg.attention_bias, cfg.mlp_bias, cfg.tie_word_embeddings, cfg.no_rope_layers) == (False, False, True,
                                                                                                (0, 0))
    assert cfg.alibi_slopes == mpt_alibi_slopes(6) and params.layers.attn_norm_b is None
    hf = cfg.to_hf()
    assert ModelConfig.from_hf(hf) == cfg
    theirs = transformers.MptConfig(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})
    assert (theirs.d_model, theirs.n_heads, theirs.n_layers) == (96, 6, 2)
    assert_logits_match(model, cfg, params, {"alibi_slopes": None},
                        {"alibi_slopes": tuple(reversed(cfg.alibi_slopes))}, backends=("xla", "pallas_interpret"))
    assert_written_back(path, cfg, params)  # (Wqkv: q, k and v one after another, exactly)


def test_mpt_engine_greedy_equals_transformers(tiny):
    _, model, cfg, params = tiny
    assert_engine_greedy(model, cfg, params, "scan")


def test_mpt_clip_qkv_equals_transformers(tmp_path_factory):
    _, model, cfg, params = tiny_loaded(tmp_path_factory, "MptConfig", "mpt_clip", **MPT,
                                        attn_config={"clip_qkv": 0.5})
    assert cfg.clip_qkv == 0.5 and cfg.to_hf()["attn_config"]["clip_qkv"] == 0.5
    assert_logits_match(model, cfg, params, {"clip_qkv": None})


GGUF_NAMES = {"wte": "token_embd", "norm_f": "output_norm", "norm_1": "attn_norm", "Wqkv": "attn_qkv",
              "out_proj": "attn_output", "norm_2": "ffn_norm", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def test_mpt_gguf_equals_the_hf_model(tiny, tmp_path):
    """As llama.cpp's converter writes MPT: its tensors as they are (`attn_qkv` q, k and v one after another), the
    ALiBi bias maximum and the head tied."""
    from safetensors.numpy import load_file

    path, model, cfg, _ = tiny
    c = model.config
    shape = SimpleNamespace(hidden_size=c.d_model, num_attention_heads=c.n_heads, num_key_value_heads=c.n_heads,
                            intermediate_size=4 * c.d_model, num_hidden_layers=c.n_layers,
                            max_position_embeddings=c.max_seq_len)  # (the shape as the converter writes it)
    w = shaped_writer(tmp_path / "mpt.gguf", "mpt", shape)
    w.add_layer_norm_eps(c.layer_norm_epsilon)
    w.add_max_alibi_bias(8.0)
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    for name, a in load_file(path / "model.safetensors").items():
        parts = name.split(".")
        block = f"blk.{parts[2]}." if parts[1] == "blocks" else ""
        w.add_tensor(f"{block}{GGUF_NAMES[parts[-2]]}.{parts[-1]}", a)
    assert_gguf_equals_hf(w, tmp_path / "mpt.gguf", cfg, model)


@pytest.mark.parametrize("change, message", [
    ({"attn_config": {"alibi": False}}, "attn_config alibi False"),
    ({"attn_config": {"qk_ln": True}}, "attn_config qk_ln True"),
    ({"attn_config": {"prefix_lm": True}}, "attn_config prefix_lm True"),
    ({"attn_config": {"softmax_scale": 0.1}}, "attn_config softmax_scale 0.1"),
    ({"attn_config": {"alibi_bias_max": 16}}, "attn_config alibi_bias_max 16"),
    ({"no_bias": False}, "no_bias False"),
    ({"expansion_ratio": 8}, "expansion_ratio 8"),
])
def test_mpt_forms_transformers_does_not_run_are_refused_by_name(change, message):
    d = {"architectures": ["MptForCausalLM"], "model_type": "mpt", "vocab_size": 160, "d_model": 64, "n_heads": 4,
         "n_layers": 2}
    ModelConfig.from_hf(d)
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_hf({**d, **change})

