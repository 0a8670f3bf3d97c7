"""GPT-2 (`GPT2LMHeadModel`) and GPTBigCode (`GPTBigCodeForCausalLM`) against transformers: tiny random models
with learned absolute positions (no rotary embedding), LayerNorms with biases, every projection biased, q, k and v
in one `c_attn` (GPT-2's a Conv1D, [in, out] as all of its weights; GPTBigCode's one KV head after the queries, or
as many KV heads as queries, each head's q, k and v together), an ungated tanh-GELU MLP and the head tied to the
embeddings. Logits (and not them without the positions), greedy tokens through the engine, the checkpoints and
configs written back under their own names and layouts, llama.cpp's "gpt2" and "starcoder" files, and the
refusals by name."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from jaxserve.config import ModelConfig  # noqa: E402
from jaxserve.errors import UnsupportedModelError  # noqa: E402
from jaxserve.loader import open_checkpoint  # noqa: E402
from tests.modelrun import prompt_logits  # noqa: E402
from tests.test_gguf_models import _ours, written  # noqa: E402
from tests.test_model_families import (  # noqa: E402
    assert_engine_greedy,
    assert_logits_match,
    assert_written_back,
    rel_err,
    tiny_loaded,
)

# (GPT2Config's own keys: the TINY shape's under GPT-2's names)
GPT2 = dict(tiny=False, vocab_size=160, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=1,
            eos_token_id=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_loaded(tmp_path_factory, "GPT2Config", "gpt2", **GPT2)


def test_gpt2_config(tiny):
    _, _, cfg, params = tiny
    assert (cfg.family, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == (
        "gpt2", 64, 4, 4, 16, 256)
    assert (cfg.hidden_act, cfg.no_rope_layers, cfg.max_position_embeddings, cfg.tie_word_embeddings) == (
        "gelu_pytorch_tanh", (0, 0), 256, True)
    assert (cfg.attention_bias, cfg.output_bias, cfg.mlp_bias, cfg.norm_bias, cfg.gated_mlp) == (True,) * 4 + (False,)
    assert params.pos_embed.shape == (256, 64)
    hf = cfg.to_hf()
    assert (hf["model_type"], hf["n_embd"], hf["activation_function"]) == ("gpt2", 64, "gelu_new")
    assert ModelConfig.from_hf(hf) == cfg
    for key, value in (("scale_attn_by_inverse_layer_idx", True), ("add_cross_attention", True),
                       ("scale_attn_weights", False)):
        with pytest.raises(UnsupportedModelError, match=f"GPT-2 with {key} {value} is not supported"):
            ModelConfig.from_hf({**hf, key: value})
    with pytest.raises(UnsupportedModelError, match="GPT-2 with activation_function 'swish' is not supported"):
        ModelConfig.from_hf({**hf, "activation_function": "swish"})


def test_gpt2_logits_match_transformers(tiny):
    """Transformers' logits; without the learned positions they are not."""
    _, model, cfg, params = tiny
    ids, ref = assert_logits_match(model, cfg, params)
    assert rel_err(prompt_logits(cfg, dataclasses.replace(params, pos_embed=params.pos_embed * 0), ids), ref) > 1e-3


def test_gpt2_checkpoint_written_back_and_engine_greedy(tiny):
    path, model, cfg, params = tiny
    assert_written_back(path, cfg, params)  # (`transformer.h.N.attn.c_attn` [in, 3 out], ... exactly)
    assert_engine_greedy(model, cfg, params, "scan")


@pytest.fixture(scope="module")
def bigcode(tmp_path_factory):
    return tiny_loaded(tmp_path_factory, "GPTBigCodeConfig", "gpt_bigcode", multi_query=True, **GPT2)


@pytest.mark.parametrize("multi_query", [True, False])
def test_gpt_bigcode_logits_and_checkpoint(bigcode, tmp_path_factory, multi_query):
    """GPTBigCode's logits, with one KV head or as many as queries (`c_attn` then laid out per head), its config and
    checkpoint written back; the engine's greedy tokens (one KV head)."""
    path, model, cfg, params = bigcode if multi_query else tiny_loaded(
        tmp_path_factory, "GPTBigCodeConfig", "gpt_bigcode", multi_query=False, **GPT2)
    assert (cfg.family, cfg.num_kv_heads, cfg.hidden_act) == (
        "gpt_bigcode", 1 if multi_query else 4, "gelu_pytorch_tanh")
    assert cfg.to_hf()["multi_query"] == multi_query and ModelConfig.from_hf(cfg.to_hf()) == cfg
    assert_logits_match(model, cfg, params)
    assert_written_back(path, cfg, params)
    if multi_query:
        assert_engine_greedy(model, cfg, params, "scan")


@pytest.mark.parametrize("arch", ["gpt2", "starcoder"])
def test_gguf_equals_the_hf_model(tiny, bigcode, tmp_path, arch):
    """A "gpt2" or "starcoder" GGUF file as llama.cpp's converter writes one (weights as [out, in], q, k and v in
    one `attn_qkv`, the positions as `position_embd`; GPT-2's embeddings again as `output`): the model's config and
    logits."""
    import gguf
    from safetensors.numpy import load_file

    path, model, cfg, _ = tiny if arch == "gpt2" else bigcode
    c = model.config
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), arch)
    for add, value in ((w.add_context_length, c.n_positions), (w.add_embedding_length, c.n_embd),
                       (w.add_feed_forward_length, 4 * c.n_embd), (w.add_block_count, c.n_layer),
                       (w.add_head_count, c.n_head), (w.add_head_count_kv, cfg.num_kv_heads),
                       (w.add_layer_norm_eps, c.layer_norm_epsilon)):
        add(value)
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    names = {"ln_1": "attn_norm", "ln_2": "ffn_norm", "c_attn": "attn_qkv", "attn.c_proj": "attn_output",
             "c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
    for name, a in load_file(path / "model.safetensors").items():
        parts = name.split(".")
        if parts[1] != "h":
            w.add_tensor({"wte": "token_embd", "wpe": "position_embd", "ln_f": "output_norm"}[parts[1]] + "."
                         + parts[2], a)
            if parts[1] == "wte" and arch == "gpt2":
                w.add_tensor("output.weight", a)
            continue
        module = parts[-2] if parts[-2] in names else ".".join(parts[-3:-1])
        w.add_tensor(f"blk.{parts[2]}.{names[module]}.{parts[-1]}", a.T if a.ndim == 2 and arch == "gpt2" else a)
    gguf_path = written(w, tmp_path / "m.gguf")
    got = open_checkpoint(gguf_path).config()
    # (GPT-2's head a copy of the embeddings; the eps a float32 in the file)
    want = dataclasses.replace(cfg, tie_word_embeddings=arch != "gpt2")
    assert dataclasses.replace(got, rms_norm_eps=cfg.rms_norm_eps) == want
    ids = np.random.default_rng(9).integers(0, c.vocab_size, 30).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(_ours(gguf_path, ids), ref, atol=1e-4 * np.abs(ref).max(), rtol=0)


def test_gptj_logits_checkpoint_and_engine(tmp_path_factory):
    """GPT-J (`GPTJForCausalLM`): attention (q, k and v apart, unbiased) and a tanh-GELU MLP side by side on one
    LayerNorm, the first `rotary_dim` dims of each head turned in interleaved pairs, an LM head with a bias; logits
    (and not them with every dim turned), its config and checkpoint written back, the engine's greedy tokens."""
    path, model, cfg, params = tiny_loaded(tmp_path_factory, "GPTJConfig", "gptj", rotary_dim=8, **GPT2)
    assert (cfg.family, cfg.rotary_dims, cfg.parallel_block, cfg.attention_bias, cfg.mlp_bias) == (
        "gptj", 8, True, False, True)
    assert params.lm_head_b is not None and params.pos_embed is None and not cfg.tie_word_embeddings
    assert cfg.to_hf()["rotary_dim"] == 8 and ModelConfig.from_hf(cfg.to_hf()) == cfg
    assert_logits_match(model, cfg, params, {"rotary_dim": None})
    assert_written_back(path, cfg, params)
    assert_engine_greedy(model, cfg, params, "scan")
