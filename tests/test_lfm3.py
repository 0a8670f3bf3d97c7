"""LFM3 (LFM2's short convolutions beside windowed and full attention, each kind on its own rotary embedding, a sigmoid
gate on each head's output, norms before and after each mixer and MLP) against HF transformers: logits, the
checkpoint's names both ways, and the engine's greedy tokens (chunked prefills past the window, the decode loop, the
prefix cache's kept states)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Lfm3Config"):
    pytest.skip("this transformers has no LFM3", allow_module_level=True)

from jaxserve.config import ModelConfig  # noqa: E402
from jaxserve.errors import UnsupportedModelError  # noqa: E402
from tests.fake_model import VOCAB  # noqa: E402
from tests.modelrun import prompt_logits  # noqa: E402
from tests.test_engine_gemma import hf_greedy  # noqa: E402
from tests.test_hybrid import NEW_TOKENS, PROMPTS, _engine, _greedy, _run  # noqa: E402
from tests.test_model_families import hf_logits, rel_err, save_tiny_hf, tiny_loaded  # noqa: E402

# Two convolution layers, two windowed attention layers (a window of 8: every prompt outgrows it) and a full one;
# the full layer turns half of each head's pairs (transformers' default), the windowed ones all of them.
TINY = dict(layer_types=["conv", "sliding_attention", "full_attention", "conv", "sliding_attention"],
            num_hidden_layers=5, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=96, sliding_window=8, conv_L_cache=4, conv_bias=True, vocab_size=VOCAB,
            max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def lfm3(tmp_path_factory):
    """(HF model, our config, our params, its directory) of a tiny LFM3."""
    path, model, cfg, params = tiny_loaded(tmp_path_factory, "Lfm3Config", "lfm3", **TINY)
    return model, cfg, params, str(path)


def test_config_reads_the_layer_kinds_rotary_embeddings_and_gate(lfm3):
    _, cfg, params, _ = lfm3
    m = cfg.mamba
    assert (cfg.family, m.kind, m.layers, cfg.attention_layers, m.conv_kernel) == ("lfm3", "short_conv", (0, 3),
                                                                                   (1, 2, 4), 4)
    assert [cfg.is_local(i) for i in (1, 2, 4)] == [True, False, True] and cfg.sliding_window == 8
    # The full layer: 4 of the 8 pairs turned at the frequencies of all 16 dims; the windowed ones' own base.
    assert cfg.rope_scaling.freq_factors == (1.0,) * 4 + (math.inf,) * 4 and cfg.rotary_dims == 16
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.intermediate_size) == (1_000_000.0, 10_000.0, 96)
    assert cfg.attn_gate_width == 1 and params.attn_layers.wq.shape == (3, 64, 4, 17)  # (each head's gate after it)
    assert params.layers.post_attn_norm.shape == (5, 64) and params.layers.post_mlp_norm.shape == (5, 64)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    untold = {k: v for k, v in cfg.to_hf().items() if k != "rope_parameters"}  # (Lfm3Config's defaults: these)
    assert ModelConfig.from_hf(untold) == cfg


def test_logits_match_transformers(lfm3):
    model, cfg, params, _ = lfm3
    ids = (PROMPTS[2] + PROMPTS[0]) * 2  # 102 tokens: windows of 8 slide far
    ours, ref = prompt_logits(cfg, params, ids), hf_logits(model, ids)
    assert rel_err(ours, ref) < 1e-4
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_each_part_changes_the_logits(lfm3):
    """The gate, the norms after each block and the windows each matter here: without one, the logits move (so the
    match above checks each)."""
    import dataclasses

    model, cfg, params, _ = lfm3
    ids = (PROMPTS[2] + PROMPTS[0]) * 2
    ref = hf_logits(model, ids)
    attn = params.attn_layers
    ungated = dataclasses.replace(params, attn_layers=dataclasses.replace(attn, wq=attn.wq.at[..., 16].set(-30.0)))
    no_post = dataclasses.replace(params, layers=dataclasses.replace(
        params.layers, post_attn_norm=jnp.ones_like(params.layers.post_attn_norm)))
    for label, c, p in (("gate", cfg, ungated), ("post norms", cfg, no_post),
                        ("window", dataclasses.replace(cfg, sliding_window=None), params)):
        assert rel_err(prompt_logits(c, p, ids), ref) > 1e-2, label


def test_options_left_at_their_defaults_are_refused():
    for key, value in (("use_attention_gate", False), ("use_sandwich_norm", False), ("attention_bias", True)):
        with pytest.raises(UnsupportedModelError, match=f"LFM3 with {key}"):
            ModelConfig.from_hf({"architectures": ["Lfm3ForCausalLM"], "model_type": "lfm3", **TINY, key: value})
    with pytest.raises(UnsupportedModelError, match="LFM3 layer types \\['mamba'\\]"):
        ModelConfig.from_hf({"architectures": ["Lfm3ForCausalLM"], **TINY, "layer_types": ["mamba"] * 5})


def test_convert_writes_the_sources_tensors(tmp_path):
    """`jaxserve convert`: every tensor under LFM3's names as the checkpoint had it; transformers reads the output
    (its config written back, rotary embeddings by layer kind) as the model."""
    from safetensors import safe_open

    from tests.test_convert import convert, write_tiny_tokenizer

    src, out = tmp_path / "src", tmp_path / "out"
    model = save_tiny_hf("Lfm3Config", src, **TINY)
    write_tiny_tokenizer(src)
    convert(src, out)
    with safe_open(str(out / "model.safetensors"), "numpy") as f, \
            safe_open(str(src / "model.safetensors"), "numpy") as g:
        assert sorted(f.keys()) == sorted(g.keys()) and "model.layers.1.self_attn.gate_proj.weight" in g.keys()
        for key in g.keys():
            np.testing.assert_array_equal(f.get_tensor(key), g.get_tensor(key), err_msg=key)
    again = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert again.config.layer_types == TINY["layer_types"]
    assert rel_err(hf_logits(again, PROMPTS[2]), hf_logits(model, PROMPTS[2])) < 1e-6


@pytest.mark.parametrize("backend", ["xla", "pallas_interpret"])
def test_engine_greedy_equals_transformers(lfm3, backend):
    """Chunked prefills beside decodes and the device's decode loop, three requests in one batch, and again from
    the prefix cache's kept states: transformers' greedy tokens; every state slot back. On the Pallas kernels too
    (here their interpreter): the windows and each head's gate as a GPU serves them."""
    model, cfg, params, path = lfm3
    expected = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    engine = _engine(cfg, params, path, attention_backend=backend)
    assert engine.runner.kv.conv.shape[:3] == (2, 1 + 4 + 4, 64) and engine.runner.kv.ssm.size == 0
    assert _greedy(engine) == expected
    assert _run(engine, PROMPTS[2], "again") == (expected[2], 24)  # (its states kept at 24 of its 30 tokens)
    assert sorted(engine.scheduler.states.free) == [1, 2, 3, 4]
    engine.check_integrity()


def test_adapters_equal_peft(tmp_path):
    """A PEFT adapter on the attention (q, k, v, o and the output gate's own projection, `g_proj`, read into
    q_proj's slot) and the MLPs (w1, w3, w2) of every layer, convolution layers' MLPs too, and one on the gate's
    projection alone: PEFT's prompt logprobs and greedy tokens, beside the base model's in one batch."""
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine_args import EngineArgs
    from tests.fake_model import save_fake_tokenizer
    from tests.test_lora import PEFT_ARGS, _adapter, adapter_equals_peft

    base = str(tmp_path / "lfm3")
    save_tiny_hf("Lfm3Config", base, **TINY)
    save_fake_tokenizer(base)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = _adapter(hf, str(tmp_path / "all"), 5, r=4, lora_alpha=8,
                          target_modules=["q_proj", "g_proj", "k_proj", "v_proj", "o_proj", "w1", "w2", "w3"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    gate = _adapter(hf, str(tmp_path / "gate"), 6, r=2, lora_alpha=8, target_modules=["g_proj"])
    engine = LLMEngine(EngineArgs(model=base, lora_modules=(("all", str(tmp_path / "all")),
                                                            ("gate", str(tmp_path / "gate"))), **PEFT_ARGS),
                       progress=False)
    adapter_equals_peft(engine, peft_model, "all", 7, atol=3e-5)
    adapter_equals_peft(engine, gate, "gate", 8, atol=3e-5)
