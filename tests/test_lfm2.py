"""LFM2 (short gated convolutions beside attention with q and k normed per head) and LFM2-MoE (experts after dense
first layers) against HF transformers: the convolution layers as a hybrid model's, each keeping a convolution state
and no SSM state; logits, the checkpoint's names both ways, and the engine's greedy tokens (chunked prefills, the
decode loop, the prefix cache's kept states)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxserve.config import ModelConfig  # noqa: E402
from jaxserve.loader import load_params, open_checkpoint  # noqa: E402
from tests.fake_model import VOCAB  # noqa: E402
from tests.modelrun import prompt_logits  # noqa: E402
from tests.test_engine_gemma import hf_greedy  # noqa: E402
from tests.test_hybrid import NEW_TOKENS, PROMPTS, _engine, _greedy, _run  # noqa: E402
from tests.test_model_families import hf_logits, rel_err, save_tiny_hf  # noqa: E402

# Three convolution layers around an attention layer; the MLP 2/3 of 144 rounded up to 32 (96 wide); biased
# convolutions and projections.
TINY = dict(layer_types=["conv", "full_attention", "conv", "conv"], num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=144, block_multiple_of=32, conv_bias=True, vocab_size=VOCAB,
            max_position_embeddings=256)
# LFM2-MoE: two dense first layers (a convolution's, the attention's), then 8 experts (2 a token, sigmoid scores
# and a bias choosing them, their weights scaled by 1.5).
MOE = dict(TINY, intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
           num_dense_layers=2, routed_scaling_factor=1.5)
_BUILT: dict[str, tuple] = {}


def _build(variant: str, tmp_path_factory) -> tuple:
    """(HF model, our config, our params, its directory) of a tiny LFM2 or LFM2-MoE, built once per module."""
    if variant not in _BUILT:
        path = tmp_path_factory.mktemp(f"lfm2_{variant}")
        model = save_tiny_hf("Lfm2Config" if variant == "dense" else "Lfm2MoeConfig", path,
                             **(TINY if variant == "dense" else MOE))
        ckpt = open_checkpoint(str(path))
        cfg = ckpt.config()
        _BUILT[variant] = model, cfg, load_params(ckpt, cfg, jnp.float32, progress=False), str(path)
    return _BUILT[variant]


@pytest.fixture(scope="module", params=["dense", "moe"])
def lfm2(request, tmp_path_factory):
    return _build(request.param, tmp_path_factory)


def test_config_reads_the_convolution_layers(lfm2):
    _, cfg, params, _ = lfm2
    m = cfg.mamba
    assert (m.kind, m.layers, cfg.attention_layers, m.conv_kernel, m.conv_bias, m.state_size) == (
        "short_conv", (0, 2, 3), (1,), 3, True, 0)
    assert (cfg.intermediate_size, cfg.qk_norm, cfg.tie_word_embeddings) == (96, True, True)
    assert params.mamba_layers.m_in.shape == (3, 64, 3 * 64) and params.mamba_layers.m_a_log is None
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    if cfg.num_experts:  # the dense first layers' MLPs and the experts' stacked apart
        assert (cfg.first_dense_layers, cfg.router_scoring, cfg.router_bias, cfg.routed_scaling_factor) == (
            2, "sigmoid", True, 1.5)
        assert params.dense_layers.w_gate.shape == (2, 64, 96) and params.mlp_layers.we_gate.shape == (2, 8, 64, 32)
        assert params.layers.w_gate is None and params.dense_layers.lora is None


def test_logits_match_transformers(lfm2):
    model, cfg, params, _ = lfm2
    ids = (PROMPTS[2] + PROMPTS[0]) * 2
    ours, ref = prompt_logits(cfg, params, ids), hf_logits(model, ids)
    assert rel_err(ours, ref) < 1e-4
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_convert_writes_the_sources_tensors(tmp_path, variant):
    """`jaxserve convert`: every tensor under LFM2's names as the checkpoint had it (LFM2-MoE's experts one by one,
    its choosing bias); transformers reads the output as the model."""
    from safetensors import safe_open

    from tests.test_convert import convert, write_tiny_tokenizer

    src, out = tmp_path / "src", tmp_path / "out"
    model = save_tiny_hf("Lfm2Config" if variant == "dense" else "Lfm2MoeConfig", src,
                         **(TINY if variant == "dense" else MOE))
    write_tiny_tokenizer(src)
    convert(src, out)
    with safe_open(str(out / "model.safetensors"), "numpy") as f, safe_open(str(src / "model.safetensors"), "numpy") as g:
        assert sorted(f.keys()) == sorted(g.keys()) and "model.layers.0.conv.conv.weight" in g.keys()
        for key in g.keys():
            np.testing.assert_array_equal(f.get_tensor(key), g.get_tensor(key), err_msg=key)
    again = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert rel_err(hf_logits(again, PROMPTS[2]), hf_logits(model, PROMPTS[2])) < 1e-6


def test_engine_greedy_equals_transformers(lfm2):
    """Chunked prefills beside decodes and the device's decode loop, three requests in one batch, and again from
    the prefix cache's kept states: transformers' greedy tokens; every state slot back."""
    model, cfg, params, path = lfm2
    expected = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    engine = _engine(cfg, params, path)
    assert engine.runner.kv.conv.shape[:3] == (3, 1 + 4 + 4, 64) and engine.runner.kv.ssm.size == 0
    assert _greedy(engine) == expected
    assert _run(engine, PROMPTS[2], "again") == (expected[2], 24)  # (its states kept at 24 of its 30 tokens)
    assert sorted(engine.scheduler.states.free) == [1, 2, 3, 4]
    engine.check_integrity()
