"""OLMo Hybrid (`OlmoHybridForCausalLM`, `config_olmo_hybrid`) against HF transformers: Gated DeltaNet layers (q, k,
v, gate, b and a projected apart, beta doubled, the gated norm's eps 1e-5) normed before their mixer and MLP, beside
OLMo 3's attention layers normed after theirs; rotated or NoPE. Logits (and not them without the doubled beta), the
checkpoints' names both ways (the q, k and v convolutions however a file divides them, transformers' names for the
norms), the engine's greedy tokens and its prefix cache's kept states."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxserve.config import ModelConfig, UnsupportedModelError  # noqa: E402
from jaxserve.loader import load_params, open_checkpoint  # noqa: E402
from jaxserve.loader.keymap import hf_names  # noqa: E402
from tests.fake_model import VOCAB  # noqa: E402
from tests.modelrun import prompt_logits  # noqa: E402
from tests.test_engine_gemma import hf_greedy  # noqa: E402
from tests.test_hybrid import NEW_TOKENS, PROMPTS, _engine, _greedy, _run  # noqa: E402
from tests.test_model_families import hf_logits, rel_err, tiny_loaded  # noqa: E402

# Three DeltaNet layers around an attention layer: 2 key heads of 8 dims, each shared by 2 value heads of 12 dims;
# attention of 4 heads of 16 dims over 2 KV heads.
TINY = dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention", "linear_attention",
                                              "linear_attention"], num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=96, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=12, vocab_size=VOCAB, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
CONVS = [f"model.layers.{i}.linear_attn.{p}_conv1d.weight" for i in (0, 2, 3) for p in "qkv"]


@pytest.fixture(scope="module")
def olmo(tmp_path_factory):
    """(HF model, our config, our params, its directory): saved by transformers, which divides each layer's
    convolution into three equal parts under the q, k and v names."""
    path, model, cfg, params = tiny_loaded(tmp_path_factory, "OlmoHybridConfig", "olmo_hybrid", **TINY)
    return model, cfg, params, path


def test_config_reads_the_deltanet_and_attention_layers(olmo):
    _, cfg, params, _ = olmo
    m = cfg.mamba
    assert (m.kind, m.layers, cfg.attention_layers, m.num_heads, m.head_dim, m.state_size, m.n_groups) == (
        "gated_delta", (0, 2, 3), (1,), 4, 12, 8, 2)
    assert (m.beta_scale, m.norm_eps, cfg.no_rope_layers, cfg.qk_norm_heads) == (2.0, 1e-5, None, True)
    # q, k (2 x 8 each), v, gate (4 x 12 each), b, a (4 each): one projection; every layer holds the four norms
    assert params.mamba_layers.m_in.shape == (3, 64, 32 + 96 + 8) and params.mamba_layers.m_conv.shape == (3, 80, 4)
    assert params.layers.attn_norm.shape == params.layers.post_mlp_norm.shape == (4, 64)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    hf = cfg.to_hf()
    assert ModelConfig.from_hf({**hf, "linear_allow_neg_eigval": False}).mamba.beta_scale == 1.0
    for bad, match in ((dict(layer_types=["sliding_attention"] + hf["layer_types"][1:]), "sliding_attention"),
                       (dict(hidden_act="gelu"), "gelu")):
        with pytest.raises(UnsupportedModelError, match=match):
            ModelConfig.from_hf({**hf, **bad})
    names = hf_names(cfg)  # a DeltaNet layer's norms before, an attention layer's after
    assert "model.layers.0.attention_layer_norm.weight" in names and "model.layers.1.attention_layer_norm.weight" \
        not in names and "model.layers.1.post_feedforward_layernorm.weight" in names


def test_logits_match_transformers(olmo):
    """Transformers' logits; beta not doubled, they are not."""
    model, cfg, params, _ = olmo
    ids = (PROMPTS[2] + PROMPTS[0]) * 2
    ours, ref = prompt_logits(cfg, params, ids), hf_logits(model, ids)
    assert rel_err(ours, ref) < 1e-4 and (ours.argmax(-1) == ref.argmax(-1)).all()
    single = dataclasses.replace(cfg, mamba=dataclasses.replace(cfg.mamba, beta_scale=1.0))
    assert rel_err(prompt_logits(single, params, ids), ref) > 1e-3


def test_nope_checkpoint(olmo, tmp_path):
    """A config whose `rope_parameters` is null (as released checkpoints have it) rotates nothing: the logits of
    transformers' model without its rotary embedding, not of the rotated one."""
    import shutil

    model, _, params, path = olmo
    for f in path.iterdir():
        shutil.copy(f, tmp_path / f.name)
    d = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**d, "rope_parameters": None}))
    cfg = open_checkpoint(str(tmp_path)).config()
    assert cfg.no_rope_layers == (0, 0, 0, 0) and cfg.to_hf()["rope_parameters"] is None
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    ids = PROMPTS[2]
    rotated, rotary = hf_logits(model, ids), model.model.rotary_emb
    model.model.rotary_emb = None
    try:
        nope = hf_logits(model, ids)
    finally:
        model.model.rotary_emb = rotary
    ours = prompt_logits(cfg, params, ids)
    assert rel_err(ours, nope) < 1e-4 and rel_err(ours, rotated) > 1e-3


def test_checkpoint_forms_read_alike(olmo, tmp_path):
    """The released form (each convolution's q, k and v parts of their own widths: 16, 16, 48 channels) and
    transformers' in-memory names for the norms (`input_layernorm`, `post_attention_layernorm`) load the same
    parameters; a convolution missing a part is refused by name."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from jaxserve.errors import CheckpointError

    _, cfg, params, path = olmo
    tensors = load_file(f"{path}/model.safetensors")
    assert [tensors[n].shape[0] for n in CONVS[:3]] == [27, 27, 26]  # (transformers' equal parts)
    released = {}
    for name, t in tensors.items():
        name = name.replace("attention_layer_norm", "input_layernorm").replace(
            "feedforward_layer_norm", "post_attention_layernorm")
        if name in CONVS:
            prefix, part = name.rsplit(".", 2)[0], name.split(".")[-2][0]
            whole = np.concatenate([tensors[f"{prefix}.{p}_conv1d.weight"] for p in "qkv"])
            t = np.split(whole, [16, 32])["qkv".index(part)]
        released[name] = t
    assert released[CONVS[2]].shape == (48, 1, 4)
    shutil.copy(f"{path}/config.json", tmp_path / "config.json")
    save_file(released, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    again = load_params(open_checkpoint(str(tmp_path)), cfg, jnp.float32, progress=False)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    del released[CONVS[4]]  # (layer 2's k part)
    save_file(released, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"layers\.2\.linear_attn\.\{q, v\}_conv1d.* not its k part"):
        load_params(open_checkpoint(str(tmp_path)), cfg, jnp.float32, progress=False)


def test_convert_writes_the_released_form(olmo, tmp_path):
    """`jaxserve convert`: every tensor under the source's names, the convolutions divided at their own widths
    (their channels in order, as the source's); transformers reads the output as the model."""
    from safetensors.numpy import load_file

    from tests.test_convert import convert, write_tiny_tokenizer

    model, _, _, src = olmo
    write_tiny_tokenizer(src)
    convert(src, tmp_path / "out")
    ours, theirs = load_file(f"{tmp_path}/out/model.safetensors"), load_file(f"{src}/model.safetensors")
    assert sorted(ours) == sorted(theirs) and [ours[n].shape[0] for n in CONVS[:3]] == [16, 16, 48]
    for name in set(theirs) - set(CONVS):
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    for i in range(0, len(CONVS), 3):
        np.testing.assert_array_equal(*(np.concatenate([t[n] for n in CONVS[i:i + 3]]) for t in (ours, theirs)))
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    assert type(again) is type(model)
    assert rel_err(hf_logits(again, PROMPTS[2]), hf_logits(model, PROMPTS[2])) < 1e-5


def test_engine_greedy_equals_transformers(olmo):
    """Chunked prefills beside decodes and the device's decode loop, three requests in one batch, and again from
    the prefix cache's kept states: transformers' greedy tokens; every state slot back."""
    model, cfg, params, path = olmo
    expected = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    engine = _engine(cfg, params, path)
    assert engine.runner.kv.ssm.shape[:5] == (3, 1 + 4 + 4, 4, 12, 8)
    assert _greedy(engine) == expected
    assert _run(engine, PROMPTS[2], "again") == (expected[2], 24)  # (its states kept at 24 of its 30 tokens)
    assert sorted(engine.scheduler.states.free) == [1, 2, 3, 4]
    engine.check_integrity()
