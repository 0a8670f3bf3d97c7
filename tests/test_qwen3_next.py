"""Qwen3-Next and Qwen3.5 (Gated DeltaNet layers beside attention gated per channel, (1 + w) norms, experts with a
gated shared expert or a dense MLP) against HF transformers: the DeltaNet layers as a hybrid model's, each keeping a
convolution state and a delta-rule state per sequence; logits, the checkpoints' names both ways (Qwen3-Next's fused
projections split and fused back), and the engine's greedy tokens (chunked prefills, the decode loop, the prefix
cache's kept states)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxserve.config import ModelConfig, UnsupportedModelError  # noqa: E402
from jaxserve.loader import load_params, open_checkpoint  # noqa: E402
from jaxserve.loader.keymap import hf_target  # noqa: E402
from tests.fake_model import VOCAB  # noqa: E402
from tests.modelrun import prompt_logits  # noqa: E402
from tests.test_engine_gemma import hf_greedy  # noqa: E402
from tests.test_hybrid import NEW_TOKENS, PROMPTS, _engine, _greedy, _run  # noqa: E402
from tests.test_model_families import hf_logits, rel_err, save_tiny_hf  # noqa: E402

# Three DeltaNet layers around an attention layer: 2 key heads of 8 dims, each shared by 2 value heads of 12 dims;
# attention of 4 heads of 16 dims (a quarter rotated) over 2 KV heads.
TINY = dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention", "linear_attention",
                                              "linear_attention"], num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=96, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=12, vocab_size=VOCAB, max_position_embeddings=256)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
VARIANTS = {"qwen3_next": ("Qwen3NextConfig", {**TINY, **MOE}), "qwen3_5": ("Qwen3_5TextConfig", TINY),
            "qwen3_5_moe": ("Qwen3_5MoeTextConfig", {**TINY, **MOE})}
_BUILT: dict[str, tuple] = {}


def _build(variant: str, tmp_path_factory) -> tuple:
    """(HF model, our config, our params, its directory) of a tiny model of `variant`, built once per module."""
    if variant not in _BUILT:
        path = tmp_path_factory.mktemp(variant)
        model = save_tiny_hf(VARIANTS[variant][0], path, **VARIANTS[variant][1])
        ckpt = open_checkpoint(str(path))
        cfg = ckpt.config()
        _BUILT[variant] = model, cfg, load_params(ckpt, cfg, jnp.float32, progress=False), str(path)
    return _BUILT[variant]


@pytest.fixture(scope="module", params=list(VARIANTS))
def qwen(request, tmp_path_factory):
    return _build(request.param, tmp_path_factory)


def test_config_reads_the_deltanet_layers(qwen):
    _, cfg, params, _ = qwen
    m = cfg.mamba
    assert (m.kind, m.layers, cfg.attention_layers, m.num_heads, m.head_dim, m.state_size, m.n_groups) == (
        "gated_delta", (0, 2, 3), (1,), 4, 12, 8, 2)
    assert (cfg.rotary_dims, cfg.q_head_dim, cfg.qk_norm, cfg.attn_gate_width) == (4, 32, True, 16)
    # q, k (2 x 2 x 8), v, z (2 x 4 x 12), b, a (4 each): one projection; its gated norm one head wide
    assert params.mamba_layers.m_in.shape == (3, 64, 32 + 96 + 8) and params.mamba_layers.m_norm.shape == (3, 12)
    assert params.mamba_layers.m_d is None and params.attn_layers.wq.shape == (1, 64, 4, 32)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    if cfg.num_experts:
        assert (cfg.num_experts, cfg.shared_expert_intermediate_size, cfg.norm_topk_prob) == (8, 48, True)
        assert params.layers.ws_mix.shape == (4, 64)
    assert hf_target("mtp.layers.0.mlp.gate.weight", cfg) is None  # (the multi-token prediction layers: not read)


def test_logits_match_transformers(qwen):
    model, cfg, params, _ = qwen
    ids = (PROMPTS[2] + PROMPTS[0]) * 2
    ours, ref = prompt_logits(cfg, params, ids), hf_logits(model, ids)
    assert rel_err(ours, ref) < 1e-4
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("variant", ["qwen3_next", "qwen3_5_moe"])
def test_convert_writes_the_sources_tensors(tmp_path, variant):
    """`jaxserve convert`: every tensor under the source's names as its checkpoint had it (Qwen3-Next's q/k/v/z and
    b/a projections fused per key head again); transformers reads the output as the model."""
    from safetensors import safe_open

    from tests.test_convert import convert, write_tiny_tokenizer

    src, out = tmp_path / "src", tmp_path / "out"
    model = save_tiny_hf(VARIANTS[variant][0], src, **VARIANTS[variant][1])
    write_tiny_tokenizer(src)
    convert(src, out)
    fused = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    with safe_open(str(out / "model.safetensors"), "numpy") as f, safe_open(str(src / "model.safetensors"), "numpy") as g:
        assert sorted(f.keys()) == sorted(g.keys()) and (fused in g.keys()) == (variant == "qwen3_next")
        for key in g.keys():
            np.testing.assert_array_equal(f.get_tensor(key), g.get_tensor(key), err_msg=key)
    again = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(again) is type(model)
    # (the same bytes; 1.2e-6 apart at most, the source model run with eager attention, the reloaded one with SDPA)
    assert rel_err(hf_logits(again, PROMPTS[2]), hf_logits(model, PROMPTS[2])) < 1e-5


@pytest.mark.parametrize("variant,backend", [("qwen3_next", "xla"), ("qwen3_5", "xla"),
                                             ("qwen3_5", "pallas_interpret")])
def test_engine_greedy_equals_transformers(tmp_path_factory, variant, backend):
    """Chunked prefills beside decodes and the device's decode loop, three requests in one batch, and again from
    the prefix cache's kept states: transformers' greedy tokens; every state slot back. On the XLA backend the
    prompts' delta rule runs token by token, on the Pallas ones (here its interpreter) chunk by chunk."""
    model, cfg, params, path = _build(variant, tmp_path_factory)
    expected = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    engine = _engine(cfg, params, path, attention_backend=backend)
    assert engine.runner.kv.ssm.shape[:5] == (3, 1 + 4 + 4, 4, 12, 8)
    assert _greedy(engine) == expected
    assert _run(engine, PROMPTS[2], "again") == (expected[2], 24)  # (its states kept at 24 of its 30 tokens)
    assert sorted(engine.scheduler.states.free) == [1, 2, 3, 4]
    engine.check_integrity()


def test_qwen3_5_image_text_config_serves_its_language_model():
    """A Qwen3.5 image-text checkpoint's config (`Qwen3_5ForConditionalGeneration`) is read as its language model
    (its multimodal rotary sections turn a text token's pairs alike); dense layers between experts are refused."""
    outer = transformers.Qwen3_5Config(text_config={k: v for k, v in TINY.items()}).to_dict()
    cfg = ModelConfig.from_hf(outer)
    assert (cfg.family, cfg.mamba.layers, cfg.rotary_dims, cfg.num_experts) == ("qwen3_5", (0, 2, 3), 4, 0)
    with pytest.raises(UnsupportedModelError, match="mlp_only_layers"):
        ModelConfig.from_hf(transformers.Qwen3NextConfig(**TINY, **MOE, mlp_only_layers=[1]).to_dict())


def test_weights_quantized_at_load(tmp_path_factory):
    """`--quantization int8` on a Qwen3-Next: its gated attention's q projection (queries and gates), its experts and
    shared expert held int8, its DeltaNet layers in float; its logits those of the float
    model of the weights it holds (int8 times scales). (Against the source's float weights the tiny random models'
    logprobs move by up to 0.5 under int8, by up to 1.0 under 0.3% noise on the DeltaNet's input projection alone:
    too sensitive for a bound.)"""
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine_args import EngineArgs
    from jaxserve.models.quantized import QuantizedWeight, dequantize
    from tests.fake_model import save_fake_tokenizer

    _, cfg, _, path = _build("qwen3_next", tmp_path_factory)
    save_fake_tokenizer(path)
    engine = LLMEngine(EngineArgs(model=path, quantization="int8", max_model_len=64, kv_cache_memory_bytes=1 << 22,
                                  dtype="float32", warmup=False), progress=False)
    held, held_cfg = engine.model.params, engine.model.config
    assert isinstance(held.attn_layers.wq, QuantizedWeight) and held.attn_layers.wq.q.shape == (1, 64, 4, 32)
    assert isinstance(held.layers.we_up, QuantizedWeight) and isinstance(held.layers.ws_down, QuantizedWeight)
    assert not isinstance(held.mamba_layers.m_in, QuantizedWeight) and held_cfg.weight_quant == "int8"
    ids = PROMPTS[2]
    ours = prompt_logits(held_cfg, held, ids)
    assert rel_err(ours, prompt_logits(cfg, dequantize(held, jnp.float32), ids)) < 1e-4
    assert rel_err(ours, prompt_logits(cfg, _build("qwen3_next", tmp_path_factory)[2], ids)) > 1e-3  # (int8 indeed)


def test_qwen3_5_moe_packed_experts_read_as_one_by_one(tmp_path_factory, tmp_path):
    """A Qwen3.5-MoE checkpoint with each layer's experts packed (`mlp.experts.gate_up_proj` [X, 2F, E], gate rows
    first, and `down_proj` [X, E, F], as transformers holds them) loads as the one saved expert by expert."""
    import shutil

    from safetensors.numpy import load_file, save_file

    _, cfg, params, path = _build("qwen3_5_moe", tmp_path_factory)
    tensors = load_file(f"{path}/model.safetensors")
    packed = {k: v for k, v in tensors.items() if ".experts." not in k}
    for layer in range(cfg.num_layers):
        at = f"model.layers.{layer}.mlp.experts."
        one = [[tensors[f"{at}{j}.{kind}_proj.weight"] for j in range(cfg.num_experts)] for kind in ("gate", "up", "down")]
        packed[f"{at}gate_up_proj"] = np.stack([np.concatenate([g, u]) for g, u in zip(one[0], one[1], strict=True)])
        packed[f"{at}down_proj"] = np.stack(one[2])
    shutil.copy(f"{path}/config.json", tmp_path / "config.json")
    save_file(packed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ckpt = open_checkpoint(str(tmp_path))
    again = load_params(ckpt, ckpt.config(), jnp.float32, progress=False)
    np.testing.assert_array_equal(np.asarray(again.layers.we_gate), np.asarray(params.layers.we_gate))
    np.testing.assert_array_equal(np.asarray(again.layers.we_down), np.asarray(params.layers.we_down))


def test_a_gated_attention_layer_fused_as_the_cpu_lays_it_out(tmp_path_factory):
    """Qwen3.5's MTP layer is a one-layer dense model of gated attention, which the CPU's unrolled layout fuses
    (`unstack_layers(fuse=True)`: q with its gates, k and v in one matrix): the logits of the stacked layout."""
    import dataclasses

    import jax

    from jaxserve.models.params import init_params
    from jaxserve.models.unstack import unstack_layers

    cfg = dataclasses.replace(_build("qwen3_5", tmp_path_factory)[1], num_layers=1, mamba=None)
    params = init_params(cfg, jax.random.PRNGKey(0), scale=0.2)
    fused = unstack_layers(params, fuse=True)
    assert fused.layers[0].wqkv is not None and fused.layers[0].wqkv.shape == (4 * 32 + 2 * 2 * 16, 64)
    ids = PROMPTS[2]
    np.testing.assert_allclose(prompt_logits(cfg, fused, ids), prompt_logits(cfg, params, ids), rtol=1e-4, atol=1e-4)
