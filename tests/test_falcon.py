"""Falcon (`FalconForCausalLM`: Falcon 7B, 40B, 180B) against transformers, tiny random models of its three forms:
the new decoder architecture (40B, 180B: attention and the MLP side by side, each on its own LayerNorm `ln_attn`,
`ln_mlp`; `num_kv_heads` KV heads, `query_key_value` holding each KV head's group of queries, then its key and
value; Falcon2-11B's with one norm for both), 7B's (one KV head, attention and the MLP side by side on one norm) and
the sequential one (`parallel_attn` false, a KV head per head). Logits, the checkpoint and config written back under its names, greedy tokens through the
engine, llama.cpp's "falcon" files (q, k and v one after another, `attn_norm_2`), and the forms refused by name."""

from __future__ import annotations

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

FORMS = {"40b": dict(new_decoder_architecture=True, num_kv_heads=2, bias=True, num_key_value_heads=2),
         "7b": dict(new_decoder_architecture=False, multi_query=True, parallel_attn=True, bias=False,
                    num_key_value_heads=1),
         "sequential": dict(new_decoder_architecture=False, multi_query=False, parallel_attn=False, bias=True,
                            num_key_value_heads=4),  # (the KV heads its attention has: the tiny config's say 2)
         # Falcon2-11B's: the new architecture's KV heads, one norm for both
         "11b": dict(new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1, bias=False,
                     num_key_value_heads=2)}
# (each form's KV heads, parallel block, norms of a parallel block, the MLP's own norm)
SHAPES = {"40b": (2, True, 2, True), "7b": (1, True, 1, False), "sequential": (4, False, 1, True),
          "11b": (2, True, 1, False)}
GGUF_NAMES = {"word_embeddings": "token_embd", "ln_f": "output_norm", "ln_attn": "attn_norm",
              "input_layernorm": "attn_norm", "ln_mlp": "attn_norm_2", "query_key_value": "attn_qkv",
              "dense": "attn_output", "dense_h_to_4h": "ffn_up", "dense_4h_to_h": "ffn_down"}


def _tiny(tmp_path_factory, form: str):
    return tiny_loaded(tmp_path_factory, "FalconConfig", f"falcon_{form}", bos_token_id=1, eos_token_id=2,
                       ffn_hidden_size=96, **FORMS[form])


@pytest.fixture(scope="module")
def tiny40(tmp_path_factory):
    return _tiny(tmp_path_factory, "40b")


@pytest.mark.parametrize("form", list(FORMS))
def test_falcon_config_logits_and_checkpoint(tmp_path_factory, tiny40, form):
    path, model, cfg, params = tiny40 if form == "40b" else _tiny(tmp_path_factory, form)
    assert (cfg.family, cfg.num_kv_heads, cfg.parallel_block, cfg.parallel_norms, cfg.mlp_own_norm) == (
        "falcon", *SHAPES[form])
    assert (cfg.hidden_act, cfg.intermediate_size, cfg.attention_bias, cfg.mlp_bias, cfg.tie_word_embeddings) == (
        "gelu", 96, FORMS[form]["bias"], FORMS[form]["bias"], True)
    assert (params.layers.mlp_norm is not None) == cfg.mlp_own_norm
    hf = cfg.to_hf()
    assert ModelConfig.from_hf(hf) == cfg
    theirs = transformers.FalconConfig(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})
    assert (theirs.num_key_value_heads, theirs.new_decoder_architecture, theirs.parallel_attn) == (
        model.config.num_key_value_heads, model.config.new_decoder_architecture, model.config.parallel_attn)
    # (a parallel block read as sequential, and the sequential one as parallel, are not it)
    assert_logits_match(model, cfg, params, {"parallel_residual": not cfg.parallel_block})
    assert_written_back(path, cfg, params)  # (`ln_attn`/`ln_mlp` or `input_layernorm`, q/k/v by group: exactly)


def test_falcon_engine_greedy_equals_transformers(tiny40):
    _, model, cfg, params = tiny40
    assert_engine_greedy(model, cfg, params, "scan")


def test_falcon_rw_alibi_equals_transformers(tmp_path_factory, monkeypatch):
    """Falcon-RW (`alibi`: no rotation; each head's scores plus its slope, scaled with them, times the key's
    position): logits on both backends (without the slopes they differ), config and checkpoint written back, greedy
    tokens through the engine. transformers rounds the bias to bfloat16 (slopes and products); here it is made in
    float32, as jaxserve makes it."""
    import math

    from transformers.models.falcon import modeling_falcon

    def float32_alibi(mask, num_heads, dtype):
        slopes = torch.tensor(alibi_slopes(num_heads), dtype=torch.float32)
        return (slopes[:, None] * ((mask.cumsum(-1) - 1) * mask)[:, None, :]).reshape(-1, 1, mask.shape[1]).to(dtype)

    monkeypatch.setattr(modeling_falcon, "build_alibi_tensor", float32_alibi)
    path, model, cfg, params = tiny_loaded(tmp_path_factory, "FalconConfig", "falcon_rw", bos_token_id=1,
                                           eos_token_id=2, ffn_hidden_size=96, alibi=True, num_attention_heads=6,
                                           hidden_size=96,                                           **{**FORMS["sequential"], "num_key_value_heads": 6})
    assert cfg.alibi_slopes == pytest.approx([s / math.sqrt(cfg.head_dim) for s in alibi_slopes(6)])
    assert cfg.no_rope_layers == (0,) * cfg.num_layers and cfg.to_hf()["alibi"]
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    assert_logits_match(model, cfg, params, {"alibi_slopes": None}, backends=("xla", "pallas_interpret"))
    assert_written_back(path, cfg, params)
    assert_engine_greedy(model, cfg, params, "scan")


@pytest.mark.parametrize("change, message", [
    ({"new_decoder_architecture": True, "parallel_attn": False}, "parallel_attn false"),
    ({"multi_query": False, "num_kv_heads": 2}, "num_kv_heads 2 of 4 heads"),
])
def test_falcon_forms_jaxserve_does_not_serve_are_refused_by_name(change, message):
    d = {"architectures": ["FalconForCausalLM"], "model_type": "falcon", "vocab_size": 160, "hidden_size": 64,
         "num_attention_heads": 4, "num_hidden_layers": 2}
    ModelConfig.from_hf(d)  # (the defaults: Falcon-7B's form)
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_hf({**d, **change})


def test_falcon_first_checkpoints_names_are_read():
    """`RWForCausalLM` configs (`n_embed`, `n_head`, `n_layer`, `n_head_kv`) as the same model."""
    new = {"architectures": ["FalconForCausalLM"], "model_type": "falcon", "vocab_size": 160, "hidden_size": 64,
           "num_attention_heads": 4, "num_hidden_layers": 2, "num_kv_heads": 2, "new_decoder_architecture": True}
    old = {"architectures": ["RWForCausalLM"], "model_type": "RefinedWeb", "vocab_size": 160, "n_embed": 64,
           "n_head": 4, "n_layer": 2, "n_head_kv": 2, "new_decoder_architecture": True}
    assert ModelConfig.from_hf(old) == ModelConfig.from_hf(new)
    assert ModelConfig.from_hf(new).num_kv_heads == 2


@pytest.mark.parametrize("form", ["40b", "7b"])
def test_falcon_gguf_equals_the_hf_model(tmp_path_factory, tiny40, tmp_path, form):
    """As llama.cpp's converter writes Falcon: q, k and v one after another in `attn_qkv`, the MLP's own norm
    `attn_norm_2` (40B's), the head tied."""
    from safetensors.numpy import load_file

    path, model, cfg, _ = tiny40 if form == "40b" else _tiny(tmp_path_factory, form)
    c = model.config
    w = shaped_writer(tmp_path / "falcon.gguf", "falcon", c)
    w.add_layer_norm_eps(c.layer_norm_epsilon)
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    g, d = c.num_attention_heads // c.num_key_value_heads, cfg.head_dim
    for name, a in load_file(path / "model.safetensors").items():
        parts = name.split(".")
        if parts[-2] == "query_key_value":  # (as the converter reorders it: each group's queries, keys, values)
            groups = a.reshape(c.num_key_value_heads, g + 2, d, *a.shape[1:])
            a = np.concatenate([x.reshape(-1, *a.shape[1:]) for x in (groups[:, :g], groups[:, g], groups[:, g + 1])])
        block = f"blk.{parts[2]}." if parts[1] == "h" else ""
        w.add_tensor(f"{block}{GGUF_NAMES[parts[-2]]}.{parts[-1]}", a)
    assert_gguf_equals_hf(w, tmp_path / "falcon.gguf", cfg, model)
