"""Falcon-H1 (`FalconH1ForCausalLM`, `config_falcon_h1`) against HF transformers: every layer a Mamba-2 mixer and
attention side by side on one normed input, then the MLP; its µP multipliers (each of them not 1 here) folded into
the weights at load and out again when written; the mixer's output ungated-normed, normed before its gate, or after.
Logits (and not them without the multipliers), the checkpoint written back, the engine's greedy tokens and its prefix
cache's kept states; what it refuses."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxserve.config import ModelConfig, UnsupportedModelError  # noqa: E402
from jaxserve.config_falcon_h1 import FalconScales  # noqa: E402
from jaxserve.loader import load_params, open_checkpoint  # noqa: E402
from tests.fake_model import VOCAB  # noqa: E402
from tests.modelrun import prompt_logits  # noqa: E402
from tests.test_engine_gemma import hf_greedy  # noqa: E402
from tests.test_hybrid import NEW_TOKENS, PROMPTS, _engine, _greedy, _run  # noqa: E402
from tests.test_model_families import hf_logits, rel_err, tiny_loaded  # noqa: E402

# Three layers, each a mixer of 4 heads of 16 channels (2 groups, states of 16) beside attention of 4 heads of 16
# dims over 2 KV heads.
TINY = dict(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=256, mamba_d_ssm=64, mamba_n_heads=4,
            mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=16, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, key_multiplier=0.7, attention_in_multiplier=1.3, attention_out_multiplier=0.8,
            ssm_in_multiplier=1.2, ssm_out_multiplier=0.6, ssm_multipliers=[0.5, 1.5, 0.7, 1.3, 0.9],
            mlp_multipliers=[1.4, 0.6], embedding_multiplier=2.0, lm_head_multiplier=0.3)
NORMS = {"none": {}, "before": dict(mamba_rms_norm=True),
         "gated": dict(mamba_rms_norm=True, mamba_norm_before_gate=False)}
_BUILT: dict[str, tuple] = {}


def _build(norm: str, tmp_path_factory) -> tuple:
    """(HF model, our config, our params, its directory) of a tiny model whose mixer's output is normed as `norm`."""
    if norm not in _BUILT:
        path, model, cfg, params = tiny_loaded(tmp_path_factory, "FalconH1Config", f"falcon_h1_{norm}", **TINY,
                                               **NORMS[norm])
        _BUILT[norm] = model, cfg, params, path
    return _BUILT[norm]


@pytest.fixture(scope="module")
def falcon(tmp_path_factory):
    return _build("none", tmp_path_factory)


def test_config_reads_every_layer_as_both(falcon):
    _, cfg, params, _ = falcon
    m = cfg.mamba
    assert (m.layers, cfg.attention_layers, m.parallel, m.gate_norm, m.num_heads, m.head_dim, m.n_groups) == (
        (0, 1, 2), (0, 1, 2), True, "none", 4, 16, 2)
    assert cfg.falcon.ssm == (0.5, 1.5, 0.7, 1.3, 0.9) and (cfg.embedding_multiplier, cfg.falcon.lm_head) == (2.0, 0.3)
    assert params.attn_layers.wq.shape == (3, 64, 4, 16) and params.mamba_layers.m_in.shape[0] == 3
    assert params.mamba_layers.m_norm is None  # (no norm of the mixer's output: `mamba_rms_norm` false)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    hf = cfg.to_hf()
    for bad, match in ((dict(attention_bias=True), "attention_bias"), (dict(projectors_bias=True), "projectors_bias"),
                       (dict(quantization_config={"quant_method": "fp8"}), "stored quantized"),
                       (dict(hidden_act="gelu"), "gelu"), (dict(ssm_multipliers=[1.0, 2.0]), "ssm_multipliers")):
        with pytest.raises(UnsupportedModelError, match=match):
            ModelConfig.from_hf({**hf, **bad})


@pytest.mark.parametrize("norm", list(NORMS))
def test_logits_match_transformers(tmp_path_factory, norm):
    """Transformers' logits, the mixer's output normed three ways; its weights read without the multipliers folded
    in, or the embedding's or the LM head's multiplier left out, they are not."""
    model, cfg, params, path = _build(norm, tmp_path_factory)
    assert cfg.mamba.gate_norm == norm
    ids = (PROMPTS[2] + PROMPTS[0]) * 2
    ref = hf_logits(model, ids)
    assert rel_err(prompt_logits(cfg, params, ids), ref) < 1e-4
    if norm != "none":
        return
    unit = dataclasses.replace(cfg, falcon=FalconScales(embedding=2.0, lm_head=0.3))
    unfolded = load_params(open_checkpoint(str(path)), unit, jnp.float32, progress=False)
    assert rel_err(prompt_logits(unit, unfolded, ids), ref) > 1e-3
    for change in (dict(embedding_multiplier=1.0), dict(logits_scaling=1.0)):
        assert rel_err(prompt_logits(dataclasses.replace(cfg, **change), params, ids), ref) > 1e-3


def test_convert_takes_the_multipliers_out_again(falcon, tmp_path):
    """`jaxserve convert`: every tensor under the source's (Bamba's) names, the multipliers out of the weights again
    (to a float32 rounding); transformers reads the output as the model."""
    from safetensors.numpy import load_file

    from tests.test_convert import convert, write_tiny_tokenizer

    model, _, _, src = falcon
    write_tiny_tokenizer(src)
    convert(src, tmp_path / "out")
    ours, theirs = load_file(f"{tmp_path}/out/model.safetensors"), load_file(f"{src}/model.safetensors")
    assert sorted(ours) == sorted(theirs) and "model.layers.0.feed_forward.gate_proj.weight" in ours
    for name, t in theirs.items():
        np.testing.assert_allclose(ours[name], t, rtol=1e-6, atol=1e-7, err_msg=name)
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    assert type(again) is type(model)
    assert rel_err(hf_logits(again, PROMPTS[2]), hf_logits(model, PROMPTS[2])) < 1e-5


def test_engine_greedy_equals_transformers(falcon):
    """Chunked prefills beside decodes and the device's decode loop, three requests in one batch, and again from
    the prefix cache's kept states: transformers' greedy tokens; every layer holds pages and states; every state
    slot back."""
    model, cfg, params, path = falcon
    expected = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    engine = _engine(cfg, params, path)
    assert engine.runner.kv.ssm.shape[0] == engine.runner.kv.k.shape[0] == 3  # (states and pages, each layer)
    assert _greedy(engine) == expected
    assert _run(engine, PROMPTS[2], "again") == (expected[2], 24)  # (its states kept at 24 of its 30 tokens)
    assert sorted(engine.scheduler.states.free) == [1, 2, 3, 4]
    engine.check_integrity()


def test_adapters_equal_peft(tmp_path):
    """A PEFT adapter on the attention (q, k, v, o) and the MLP (gate, up, down) of every layer: its deltas scaled
    by the multipliers folded into those weights (the attention's input, the keys', the attention's output, the
    MLP's gate and output), PEFT's prompt logprobs and greedy tokens beside the base model's."""
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine_args import EngineArgs
    from tests.fake_model import save_fake_tokenizer
    from tests.test_lora import PEFT_ARGS, _adapter, adapter_equals_peft
    from tests.test_model_families import save_tiny_hf

    base = str(tmp_path / "falcon_h1")
    save_tiny_hf("FalconH1Config", base, **TINY)
    save_fake_tokenizer(base)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = _adapter(hf, str(tmp_path / "all"), 5, r=4, lora_alpha=8, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    engine = LLMEngine(EngineArgs(model=base, lora_modules=(("all", str(tmp_path / "all")),), **PEFT_ARGS),
                       progress=False)
    adapter_equals_peft(engine, peft_model, "all", 7, atol=3e-5)
