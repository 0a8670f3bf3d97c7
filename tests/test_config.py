"""ModelConfig from HF config dicts and GGUF metadata; refusals; rotary frequencies against transformers."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxserve.config import ModelConfig, RopeScaling, UnsupportedModelError, rope_inv_freq_and_scale

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

TINY = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def hf_dict(config_cls: str, **overrides) -> dict:
    """The config.json dict transformers writes for `config_cls` (TINY shape + overrides)."""
    return getattr(transformers, config_cls)(**{**TINY, **overrides}).to_dict()


# ---------------------------------------------------------------- parsing


def test_llama_from_transformers_dict():
    cfg = ModelConfig.from_hf(hf_dict("LlamaConfig", rope_theta=500000.0, rms_norm_eps=1e-5,
                                      tie_word_embeddings=True))
    assert (cfg.family, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == ("llama", 100, 64, 96)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (3, 4, 2, 16)
    assert cfg.rope_theta == 500000.0 and cfg.rms_norm_eps == 1e-5
    assert cfg.tie_word_embeddings and not cfg.attention_bias and not cfg.qk_norm
    assert cfg.sliding_window is None and cfg.rope_scaling == RopeScaling()
    assert cfg.q_per_kv == 2


def test_llama_biases_follow_the_config():
    cfg = ModelConfig.from_hf(hf_dict("LlamaConfig", attention_bias=True, mlp_bias=True))
    assert cfg.attention_bias and cfg.mlp_bias


def test_qwen2_always_has_qkv_bias():
    cfg = ModelConfig.from_hf(hf_dict("Qwen2Config"))
    assert cfg.family == "qwen2" and cfg.attention_bias and not cfg.mlp_bias and not cfg.qk_norm
    # HF's Qwen2 attention ignores `attention_bias`; so must we.
    assert ModelConfig.from_hf({**hf_dict("Qwen2Config"), "attention_bias": False}).attention_bias


def test_qwen3_qk_norm_and_explicit_head_dim():
    cfg = ModelConfig.from_hf(hf_dict("Qwen3Config", head_dim=24))
    assert cfg.family == "qwen3" and cfg.qk_norm and cfg.head_dim == 24 and not cfg.attention_bias
    assert cfg.head_dim * cfg.num_heads != cfg.hidden_size


def test_mistral_sliding_window_and_no_bias():
    d = hf_dict("MistralConfig", sliding_window=8)
    cfg = ModelConfig.from_hf({**d, "attention_bias": True})
    assert cfg.family == "mistral" and cfg.sliding_window == 8 and not cfg.attention_bias
    assert ModelConfig.from_hf(hf_dict("MistralConfig", sliding_window=None)).sliding_window is None


@pytest.mark.parametrize("overrides, window", [
    ({}, None),  # use_sliding_window defaults to False
    ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}, 8),  # every layer windowed
    ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 3}, None),  # windows start past the end
    ({"use_sliding_window": False, "sliding_window": 8, "max_window_layers": 0}, None),
])
def test_qwen_sliding_window_follows_hf_layer_types(overrides, window):
    for cls in ("Qwen2Config", "Qwen3Config"):
        d = hf_dict(cls, **overrides)
        assert ModelConfig.from_hf(d).sliding_window == window, (cls, overrides)
        # Without the derived `layer_types` (older config.json files) the answer is the same.
        d.pop("layer_types")
        assert ModelConfig.from_hf(d).sliding_window == window, (cls, overrides)


def test_legacy_rope_keys():
    """transformers 4.x files: `rope_theta` at the top level and `rope_scaling` with `type`."""
    d = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 1, "num_attention_heads": 4, "rope_theta": 1234.0,
         "rope_scaling": {"type": "linear", "factor": 2.0}}
    cfg = ModelConfig.from_hf(d)
    assert cfg.rope_theta == 1234.0 and cfg.num_kv_heads == 4 and cfg.head_dim == 8
    assert cfg.rope_scaling.rope_type == "linear" and cfg.rope_scaling.factor == 2.0


def test_model_type_without_architectures():
    d = {**hf_dict("Qwen3Config"), "architectures": None}
    assert ModelConfig.from_hf(d).family == "qwen3"


@pytest.mark.parametrize("cfg", [
    ModelConfig.from_hf(hf_dict("LlamaConfig", tie_word_embeddings=True, attention_bias=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    ModelConfig.from_hf(hf_dict("Qwen2Config", use_sliding_window=True, sliding_window=16, max_window_layers=0)),
    ModelConfig.from_hf(hf_dict("Qwen3Config", head_dim=24, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128})),
    ModelConfig.from_hf(hf_dict("MistralConfig", sliding_window=32)),
    ModelConfig.from_hf(hf_dict("Gemma2Config", head_dim=16, sliding_window=32, query_pre_attn_scalar=24)),
    ModelConfig.from_hf(hf_dict("Gemma3TextConfig", head_dim=16, sliding_window=32, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})),
], ids=["llama3", "qwen2-window", "qwen3-yarn", "mistral", "gemma2", "gemma3"])
def test_to_hf_round_trips(cfg):
    """What `jaxserve convert` writes parses back to the same config, through transformers too."""
    d = cfg.to_hf()
    assert ModelConfig.from_hf(d) == cfg
    hf_cls = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "mistral": "MistralConfig",
              "gemma2": "Gemma2Config", "gemma3": "Gemma3TextConfig"}
    through_hf = getattr(transformers, hf_cls[cfg.family]).from_dict(d).to_dict()
    assert ModelConfig.from_hf(through_hf) == cfg
    if cfg.family == "qwen2":
        assert set(through_hf["layer_types"]) == {"sliding_attention"}


def test_gguf_metadata():
    meta = {
        "general.architecture": "qwen3", "qwen3.embedding_length": 64, "qwen3.feed_forward_length": 96,
        "qwen3.block_count": 2, "qwen3.attention.head_count": 4, "qwen3.attention.head_count_kv": 2,
        "qwen3.attention.key_length": 24, "qwen3.context_length": 4096, "qwen3.rope.freq_base": 1e6,
        "qwen3.attention.layer_norm_rms_epsilon": 1e-6, "qwen3.rope.scaling.type": "yarn",
        "qwen3.rope.scaling.factor": 4.0, "qwen3.rope.scaling.original_context_length": 1024,
    }
    cfg = ModelConfig.from_gguf_metadata(meta, vocab_size=100, has_output_weight=False)
    assert (cfg.family, cfg.head_dim, cfg.num_kv_heads, cfg.rope_theta) == ("qwen3", 24, 2, 1e6)
    assert cfg.qk_norm and cfg.tie_word_embeddings and cfg.rms_norm_eps == 1e-6
    assert cfg.rope_scaling == RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024)
    with pytest.raises(UnsupportedModelError, match="missing qwen3.block_count"):
        ModelConfig.from_gguf_metadata({k: v for k, v in meta.items() if k != "qwen3.block_count"}, 100, False)
    with pytest.raises(UnsupportedModelError, match="GGUF rope scaling type 'longrope' is not supported"):
        ModelConfig.from_gguf_metadata({**meta, "qwen3.rope.scaling.type": "longrope"}, 100, False)


def test_bundled_smollm2_config(smollm_path):
    from jaxserve.loader import open_checkpoint

    cfg = open_checkpoint(smollm_path).config()
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert (cfg.head_dim, cfg.vocab_size, cfg.intermediate_size) == (64, 49152, 1536)
    assert cfg.tie_word_embeddings and cfg.rope_scaling.rope_type == "default"


# ---------------------------------------------------------------- refusals


def test_refuses_unsupported_architecture():
    with pytest.raises(UnsupportedModelError, match=r"\['RwkvForCausalLM'\] is not supported \(supported: "
                                                    r"LlamaForCausalLM, Qwen2ForCausalLM"):
        ModelConfig.from_hf({**hf_dict("LlamaConfig"), "architectures": ["RwkvForCausalLM"], "model_type": "rwkv"})


def test_refuses_heads_not_divisible():
    with pytest.raises(UnsupportedModelError, match=r"num_heads \(6\) must be a multiple of num_kv_heads \(4\)"):
        ModelConfig.from_hf(hf_dict("LlamaConfig", hidden_size=96, num_attention_heads=6, num_key_value_heads=4))


@pytest.mark.parametrize("change, message", [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
     "rope_scaling type 'dynamic' is not supported"),
    ({"head_dim": 15}, "head_dim must be even"),
    ({"partial_rotary_factor": 0.3125}, r"the rotary dims must be even and 1 to head_dim \(16\), got 5"),
    ({"num_hidden_layers": 0}, "num_layers must be a positive integer"),
])
def test_refuses_unsupported_options(change, message):
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_hf({**hf_dict("LlamaConfig"), **change})


@pytest.mark.parametrize("config_cls, change, message", [
    ("SeedOssConfig", {"attention_out_bias": True}, "Seed-OSS with attention_out_bias is not supported"),
    ("SeedOssConfig", {"mlp_bias": True}, "Seed-OSS with mlp_bias is not supported"),
    ("Ernie4_5_MoeConfig", {"moe_layer_interval": 2}, "ERNIE 4.5 MoE layers every 2 layers"),
    ("Ernie4_5_MoeConfig", {"use_bias": True}, "ERNIE 4.5 MoE with use_bias"),
    ("Glm4MoeConfig", {"n_routed_experts": 6, "n_group": 4, "num_experts_per_tok": 2}, r"expert groups: 6 experts in 4 groups"),
    ("Glm4MoeConfig", {"first_k_dense_replace": 4, "num_hidden_layers": 4}, r"first_dense_layers \(4\) must leave"),
    ("Dots1Config", {"layer_types": ["sliding_attention", "full_attention"]}, "dots1 with sliding-window layers"),
])
def test_refuses_family_options_it_cannot_run(config_cls, change, message):
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_hf({**hf_dict(config_cls), **change})


def test_gemma_configs_as_published():
    """Gemma 2 and Gemma 3 config.json files as published (before `layer_types` and per-type rotary
    parameters): the window pattern and the two rotary bases come from the older keys."""
    gemma2 = ModelConfig.from_hf({
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "vocab_size": 256000, "hidden_size": 2304,
        "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256, "sliding_window": 4096, "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0, "rope_theta": 10000.0, "max_position_embeddings": 8192})
    assert gemma2.layer_types[:3] == ("sliding_attention", "full_attention", "sliding_attention")
    assert gemma2.tie_word_embeddings and gemma2.sliding_window == 4096 and not gemma2.qk_norm
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap, gemma2.sm_scale) == (50.0, 30.0, 1 / 16)
    assert [gemma2.is_local(i) for i in range(4)] == [True, False, True, False]
    gemma3 = ModelConfig.from_hf({
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144,
        "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256, "sliding_window": 512, "sliding_window_pattern": 6, "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0, "rope_scaling": None, "final_logit_softcapping": None,
        "attn_logit_softcapping": None, "max_position_embeddings": 32768})
    assert [i for i in range(26) if not gemma3.is_local(i)] == [5, 11, 17, 23]
    assert (gemma3.rope_theta, gemma3.rope_local_theta, gemma3.qk_norm) == (1e6, 1e4, True)
    assert gemma3.attn_logit_softcap is None and not gemma3.uniform_layers
    with pytest.raises(UnsupportedModelError, match="layer_types"):
        dataclasses.replace(gemma3, layer_types=("full_attention",) * 3)


def test_refuses_mixed_sliding_layers():
    d = hf_dict("Qwen2Config", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert d["layer_types"] == ["full_attention", "sliding_attention", "sliding_attention"]
    with pytest.raises(UnsupportedModelError, match="per-layer sliding windows"):
        ModelConfig.from_hf(d)


def test_config_is_hashable_and_frozen():
    cfg = ModelConfig.from_hf(hf_dict("LlamaConfig"))
    assert hash(cfg) == hash(ModelConfig.from_hf(hf_dict("LlamaConfig")))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_layers = 2  # type: ignore[misc]


# ---------------------------------------------------------------- rotary frequencies

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "llama3-wide": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 32.0, "low_freq_factor": 2.0,
                    "high_freq_factor": 8.0, "original_max_position_embeddings": 256},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128},
    "yarn-betas": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 8.0, "original_max_position_embeddings": 64,
                   "beta_fast": 16.0, "beta_slow": 2.0},
    "yarn-mscale": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                    "original_max_position_embeddings": 128, "mscale": 0.707, "mscale_all_dim": 1.0},
    "yarn-attention-factor": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                              "original_max_position_embeddings": 128, "attention_factor": 0.8},
    # gpt-oss's: the correction range's ends not rounded
    "yarn-untruncated": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
}


@pytest.mark.parametrize("name", list(ROPES))
@pytest.mark.parametrize("head_dim", [16, 64])
def test_rope_matches_transformers(name, head_dim):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = transformers.LlamaConfig(**{**TINY, "head_dim": head_dim, "rope_parameters": dict(ROPES[name])})
    rope_type = ROPES[name]["rope_type"]
    if rope_type == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        emb = LlamaRotaryEmbedding(hf_config)
        ref_inv, ref_scale = emb.inv_freq, emb.attention_scaling
    else:
        ref_inv, ref_scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    cfg = ModelConfig.from_hf(hf_config.to_dict())
    inv, scale = rope_inv_freq_and_scale(cfg)
    np.testing.assert_allclose(np.asarray(inv), ref_inv.double().numpy(), rtol=1e-6)
    assert scale == pytest.approx(float(ref_scale), rel=1e-9)
    if rope_type != "default":  # the scaling does something on these configs
        plain, _ = rope_inv_freq_and_scale(dataclasses.replace(cfg, rope_scaling=RopeScaling()))
        assert not np.allclose(inv, plain)


def test_longrope_config():
    """Phi-3.5's config (LongRoPE; 131072 positions over an original 4096): served to 131072, the long factors
    past 4096, both sets with the attention factor sqrt(1 + ln 32 / ln 4096), as transformers computes it;
    written back, the config reads the same."""
    import math

    d = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 32064, "hidden_size": 3072,
         "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
         "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
         "rope_scaling": {"type": "longrope", "short_factor": [1.0 + i / 48 for i in range(48)],
                          "long_factor": [2.0 + i for i in range(48)]}, "sliding_window": 262144}
    cfg = ModelConfig.from_hf(d)
    rs = cfg.rope_scaling
    assert (cfg.family, cfg.max_position_embeddings, rs.rope_type, len(rs.short_factor)) == (
        "mistral", 131072, "longrope", 48)
    assert cfg.long_rope_context == 4096
    assert rs.attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


def test_phi4_mini_partial_rotary_round_trip():
    """Phi-4-mini's config: LongRoPE over 96 of each head's 128 dims (partial_rotary_factor 0.75): 48 factors,
    and the config written back reads the same."""
    d = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 200064, "hidden_size": 3072,
         "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 24, "num_key_value_heads": 8,
         "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "partial_rotary_factor": 0.75,
         "rope_theta": 10000.0, "tie_word_embeddings": True,
         "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48}}
    cfg = ModelConfig.from_hf(d)
    assert (cfg.head_dim, cfg.rotary_dim, cfg.rotary_dims, cfg.max_position_embeddings) == (128, 96, 96, 131072)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    with pytest.raises(UnsupportedModelError, match="short_factor has 64 values; the 96 rotary dims"):
        ModelConfig.from_hf({**d, "rope_scaling": {**d["rope_scaling"], "short_factor": [1.0] * 64}})
