"""Nemotron-H (blocks of a Mamba-2 mixer, attention without rotary embedding, a squared-ReLU MLP, or Nemotron 3's
MoE of ungated squared-ReLU experts) against HF transformers: its blocks paired into hybrid layers (a mixer alone, an
MLP alone), logits, the checkpoint's names both ways, and the engine's greedy tokens."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxserve.config import ModelConfig, UnsupportedModelError  # noqa: E402
from jaxserve.config_nemotron import pair_blocks  # noqa: E402
from jaxserve.loader import load_params, open_checkpoint  # noqa: E402
from jaxserve.models.inputs import KVCache  # noqa: E402
from tests.fake_model import VOCAB  # noqa: E402
from tests.modelrun import prompt_logits  # noqa: E402
from tests.test_engine_gemma import hf_greedy  # noqa: E402
from tests.test_hybrid import NEW_TOKENS, PROMPTS, _engine, _greedy, _run, int8_prompt_logprobs  # noqa: E402
from tests.test_model_families import hf_logits, rel_err, save_tiny_hf  # noqa: E402

# Blocks: Mamba + MLP, Mamba alone, attention + MLP, Mamba + MLP, an MLP alone (five layers of eight blocks);
# biased Mamba projections and MLP, dt clamped from above.
PATTERN = "M-M*-M--"
TINY = dict(hybrid_override_pattern=PATTERN, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=96, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4,
            max_position_embeddings=256, vocab_size=VOCAB, mlp_bias=True, use_bias=True, time_step_limit=[0.0, 0.5])
# Nemotron 3's: MoE blocks (8 ungated experts in 2 groups, DeepSeek-V3's routing, a shared expert) after Mamba and
# attention blocks, a Mamba block alone.
MOE = {**TINY, "hybrid_override_pattern": "MEM*EME", "n_routed_experts": 8, "num_experts_per_tok": 2,
       "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 48, "n_group": 2, "topk_group": 1,
       "routed_scaling_factor": 2.5, "mlp_bias": False}
# Nemotron 3 Super's latent MoE: the experts read and write 24 wide, projected to it from the 64-wide model and back.
LATENT = {**MOE, "moe_latent_size": 24}
_BUILT: dict[str, tuple] = {}


def _build(variant: str, tmp_path_factory) -> tuple:
    """(HF model, our config, our params, its directory) of a tiny Nemotron-H, built once per module."""
    if variant not in _BUILT:
        path = tmp_path_factory.mktemp(f"nemotron_h_{variant}")
        model = save_tiny_hf("NemotronHConfig", path, **{"dense": TINY, "moe": MOE, "latent": LATENT}[variant])
        ckpt = open_checkpoint(str(path))
        cfg = ckpt.config()
        _BUILT[variant] = model, cfg, load_params(ckpt, cfg, jnp.float32, progress=False), str(path)
    return _BUILT[variant]


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory):
    return _build("dense", tmp_path_factory)


@pytest.fixture(scope="module", params=["dense", "moe"])
def both(request, tmp_path_factory):
    return _build(request.param, tmp_path_factory)


def test_blocks_pair_into_layers(nemotron):
    assert pair_blocks(PATTERN) == [("M", True), ("M", False), ("*", True), ("M", True), ("", True)]
    assert pair_blocks("--M*") == [("", True), ("", True), ("M", False), ("*", False)]
    _, cfg, params, _ = nemotron
    m = cfg.mamba
    assert (cfg.num_layers, m.layers, cfg.attention_layers, m.no_mlp, m.no_mixer) == (5, (0, 1, 3), (2,), (1,), (4,))
    assert (cfg.hidden_act, cfg.gated_mlp, cfg.no_rope_layers, m.proj_bias, m.time_step_max) == (
        "relu2", False, (0,) * 5, True, 0.5)
    # Four MLPs stacked apart; the pages hold the attention layer only.
    assert params.mlp_layers.w_up.shape == (4, 64, 96) and params.layers.w_up is None
    assert KVCache.bytes_per_page(cfg, 8, jnp.float32) == 8 * 2 * 2 * 16 * 4
    again = ModelConfig.from_hf(cfg.to_hf())
    assert again == cfg and "".join({"linear_attention": "M", "full_attention": "*", "mlp": "-"}[b]
                                    for b in cfg.to_hf()["layers_block_type"]) == PATTERN
    d = cfg.to_hf()
    for key, value, error in (("layers_block_type", ["moe", "full_attention", "mlp"], "MoE blocks"),
                              ("attention_bias", True, "attention_bias True"),
                              ("mamba_hidden_act", "gelu", "mamba_hidden_act 'gelu'"),
                              ("layers_block_type", ["mlp", "linear_attention"], "needs Mamba and attention")):
        with pytest.raises(UnsupportedModelError, match=error):
            ModelConfig.from_hf({**d, key: value})


def test_moe_blocks(tmp_path_factory):
    _, cfg, params, _ = _build("moe", tmp_path_factory)
    m = cfg.mamba
    assert (cfg.num_layers, m.layers, cfg.attention_layers, m.no_mlp, m.no_mixer) == (4, (0, 1, 3), (2,), (1,), ())
    assert (cfg.num_experts, cfg.router_scoring, cfg.expert_groups, cfg.shared_expert_intermediate_size,
            cfg.routed_scaling_factor) == (8, "sigmoid", 2, 48, 2.5)
    assert params.mlp_layers.we_gate is None and params.mlp_layers.we_up.shape == (3, 8, 64, 32)
    assert params.mlp_layers.ws_gate is None and params.mlp_layers.router_bias.shape == (3, 8)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg and cfg.moe_latent_size == 0
    with pytest.raises(UnsupportedModelError, match="MoE blocks with mlp_bias"):
        ModelConfig.from_hf({**cfg.to_hf(), "mlp_bias": True})
    with pytest.raises(UnsupportedModelError, match="both MLP and MoE blocks"):
        ModelConfig.from_hf({**cfg.to_hf(), "layers_block_type": ["mamba", "mlp", "attention", "moe"]})


def test_latent_moe_blocks_match_transformers(tmp_path_factory):
    """Nemotron 3 Super's latent MoE: routed on the model's width, the experts run 24 wide between the two latent
    projections (the shared expert on the model's width); logits of transformers'."""
    model, cfg, params, _ = _build("latent", tmp_path_factory)
    assert (cfg.moe_latent_size, cfg.expert_width) == (24, 24) and ModelConfig.from_hf(cfg.to_hf()) == cfg
    assert params.mlp_layers.we_up.shape == (3, 8, 24, 32) and params.mlp_layers.we_down.shape == (3, 8, 32, 24)
    assert params.mlp_layers.we_latent_in.shape == (3, 64, 24) and params.mlp_layers.we_latent_out.shape == (3, 24, 64)
    ids = (PROMPTS[2] + PROMPTS[0]) * 2
    ours, ref = prompt_logits(cfg, params, ids), hf_logits(model, ids)
    assert rel_err(ours, ref) < 1e-4 and (ours.argmax(-1) == ref.argmax(-1)).all()


def test_logits_match_transformers(both):
    model, cfg, params, _ = both
    ids = (PROMPTS[2] + PROMPTS[0]) * 2  # 102 tokens: two of the chunked scan's chunks
    ours, ref = prompt_logits(cfg, params, ids), hf_logits(model, ids)
    assert rel_err(ours, ref) < 1e-4
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("variant", ["dense", "moe", "latent"])
def test_convert_writes_the_sources_tensors(tmp_path, variant):
    """`jaxserve convert`: every tensor under its block's name (`backbone.layers.{block}.mixer...`, the experts one
    by one, the latent projections) as the checkpoint had it; transformers reads the output as the model."""
    from safetensors import safe_open

    from tests.test_convert import convert, write_tiny_tokenizer

    src, out = tmp_path / "src", tmp_path / "out"
    model = save_tiny_hf("NemotronHConfig", src, **{"dense": TINY, "moe": MOE, "latent": LATENT}[variant])
    write_tiny_tokenizer(src)
    convert(src, out)
    with safe_open(str(out / "model.safetensors"), "numpy") as f, safe_open(str(src / "model.safetensors"), "numpy") as g:
        assert sorted(f.keys()) == sorted(g.keys()) and any(k.endswith("mixer.up_proj.weight") or k.endswith(
            "mixer.experts.7.up_proj.weight") for k in g.keys())
        assert any(k.endswith("mixer.fc2_latent_proj.weight") for k in g.keys()) == (variant == "latent")
        for key in g.keys():
            np.testing.assert_array_equal(f.get_tensor(key), g.get_tensor(key), err_msg=key)
    again = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert rel_err(hf_logits(again, PROMPTS[2]), hf_logits(model, PROMPTS[2])) < 1e-6


def test_engine_greedy_equals_transformers(both):
    """Chunked prefills beside decodes and the device's decode loop, three requests in one batch, and again with
    prefix caching from the same prompts' kept states: transformers' greedy tokens; every state slot back."""
    model, cfg, params, path = both
    expected = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    engine = _engine(cfg, params, path)
    assert _greedy(engine) == expected
    assert _run(engine, PROMPTS[2], "again") == (expected[2], 24)  # (its states kept at 24 of its 30 tokens)
    assert sorted(engine.scheduler.states.free) == [1, 2, 3, 4]
    engine.check_integrity()


def test_moe_weights_quantized_at_load(tmp_path_factory):
    """`--quantization int8` on a Nemotron 3: its ungated experts and shared expert (on the MLPs' own stack) held
    int8, its Mamba layers in float; prompt logprobs within 0.05 of the float model's."""
    from jaxserve.models.quantized import QuantizedWeight

    held, difference = int8_prompt_logprobs(_build("moe", tmp_path_factory)[3])
    assert isinstance(held.mlp_layers.we_up, QuantizedWeight) and isinstance(held.mlp_layers.ws_down, QuantizedWeight)
    assert held.mlp_layers.we_gate is None and not isinstance(held.mamba_layers.m_in, QuantizedWeight)
    assert 0 < difference < 0.05
