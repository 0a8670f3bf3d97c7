"""DeepSeek-V2 and -V3 (multi-head latent attention, `jaxserve.config_mla`) against transformers.

Tiny random models saved from transformers' config classes: DeepSeek-V2 without a query bottleneck and with its
grouped softmax routing, DeepSeek-V3 with the bottleneck, YaRN (whose mscale changes the attention scale) and its
grouped sigmoid routing. Logits of a prompt, greedy tokens through the engine (chunked and batched, layers
unrolled and scanned), a prefix hit against a miss, the page pool's latent entries, and the checkpoint written back.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from jaxserve.config import ModelConfig, UnsupportedModelError  # noqa: E402
from jaxserve.loader import HFDirectory, load_params  # noqa: E402
from jaxserve.loader.assembler import WeightAssembler  # noqa: E402
from jaxserve.loader.keymap import hf_tensors  # noqa: E402
from jaxserve.models.inputs import KVCache  # noqa: E402
from jaxserve.models.params import param_paths  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402
from tests.modelrun import drain, prompt_logits, tiny_engine  # noqa: E402
from tests.test_model_families import hf_logits, random_prompt, rel_err, save_tiny_hf  # noqa: E402

REL_TOL = 1e-4
_MLA = dict(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
            first_k_dense_replace=1, num_hidden_layers=3)
FAMILIES = {
    # DeepSeek-V2 (as V2-Lite: no query bottleneck); experts in 2 groups, the one with the best single score open
    # (with as many groups open as experts chosen, the choice would be the plain top-k).
    "deepseek_v2": ("DeepseekV2Config", {**_MLA, "q_lora_rank": None, "topk_method": "group_limited_greedy",
                                         "n_group": 2, "topk_group": 1, "routed_scaling_factor": 1.5}),
    # DeepSeek-V3: a query bottleneck, YaRN with its mscale (the attention scale times mscale squared), sigmoid
    # scores with a bias for choosing in 2 groups of which 1 is open, renormalized, times 2.5.
    "deepseek_v3": ("DeepseekV3Config", {**_MLA, "q_lora_rank": 24, "n_group": 2, "topk_group": 1,
                                         "routed_scaling_factor": 2.5,
                                         "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0,
                                                             "mscale_all_dim": 1.0, "beta_fast": 32.0,
                                                             "beta_slow": 1.0, "rope_theta": 10000.0,
                                                             "original_max_position_embeddings": 64}}),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny_mla(request, tmp_path_factory):
    """(family, checkpoint path, transformers' model, our config, our params)."""
    cls, overrides = FAMILIES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    model = save_tiny_hf(cls, path, **overrides)
    ckpt = HFDirectory(path)
    cfg = ckpt.config()
    return request.param, path, model, cfg, load_params(ckpt, cfg, jnp.float32, progress=False)


def test_mla_config(tiny_mla):
    family, _, _, cfg, _ = tiny_mla
    o = FAMILIES[family][1]
    assert cfg.family == family
    assert (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.v_head_dim) == (32, o["q_lora_rank"] or 0, 12)
    assert (cfg.head_dim, cfg.rotary_dims, cfg.num_kv_heads) == (24, 8, 1)  # one latent, shared by the 4 heads
    assert cfg.kv_cache_dims == (40, 0)
    assert (cfg.expert_groups, cfg.expert_topk_groups, cfg.routed_scaling_factor) == (
        o["n_group"], o["topk_group"], o["routed_scaling_factor"])
    assert cfg.router_scoring == ("softmax" if family == "deepseek_v2" else "sigmoid")
    mscale = 0.1 * np.log(4.0) + 1.0 if family == "deepseek_v3" else 1.0
    assert cfg.sm_scale == pytest.approx(24 ** -0.5 * mscale**2)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


def test_mla_logits_match_transformers(tiny_mla):
    family, _, model, cfg, params = tiny_mla
    ids = random_prompt()
    ours, ref = prompt_logits(cfg, params, ids), hf_logits(model, ids)
    assert rel_err(ours, ref) < REL_TOL
    # What the test would miss otherwise: the routing's groups, and (V3) YaRN's mscale in the attention scale.
    ungrouped = dataclasses.replace(cfg, expert_groups=1, expert_topk_groups=1)
    assert rel_err(prompt_logits(ungrouped, params, ids), ref) > 1e-3
    if family == "deepseek_v3":
        plain = dataclasses.replace(cfg, rope_scaling=dataclasses.replace(cfg.rope_scaling, mscale_all_dim=None))
        assert rel_err(prompt_logits(plain, params, ids), ref) > 1e-3


def test_mla_pages_hold_one_latent_per_token(tiny_mla):
    _, _, _, cfg, _ = tiny_mla
    kv = KVCache.allocate(cfg, 4, 8, jnp.float32)
    assert kv.k.shape == (3, 4, 8, 1, 40) and kv.v.shape == (3, 4, 8, 1, 0)
    # 40 floats a token a layer, against 2 x 4 heads x 24 dims expanded.
    assert KVCache.bytes_per_page(cfg, 8, jnp.float32) == 3 * 8 * 40 * 4


def test_mla_checkpoint_written_back_reads_the_same(tiny_mla):
    """Our parameters as an HF checkpoint (rotary rows interleaved again, kv_b_proj joined) read back equal."""
    from safetensors.numpy import load_file

    _, path, _, cfg, params = tiny_mla
    host = {k: np.asarray(v) for k, v in param_paths(params).items()}
    saved = {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}
    written = dict(hf_tensors(cfg, host))
    assert set(written) == set(saved)
    for name, t in written.items():  # the checkpoint's own tensors, exactly
        np.testing.assert_array_equal(t, saved[name], err_msg=name)
    again = WeightAssembler(cfg, np.float32)
    for name, t in written.items():
        again.add(name, t)
    for path, value in param_paths(again.finish()).items():
        np.testing.assert_array_equal(np.asarray(value), host[path], err_msg=path)


def test_mla_engine_greedy_equals_transformers(tiny_mla):
    """Chunked prefill (21 tokens: 16 + 5) and batched decode, layers unrolled (V2) and scanned (V3):
    transformers' tokens."""
    from tests.test_engine_gemma import NEW_TOKENS, PROMPTS, _greedy, hf_greedy

    family, _, model, cfg, params = tiny_mla
    expected = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    loop = "unroll" if family == "deepseek_v2" else "scan"  # (the dense first layer, then the MoE ones: 2 stacks)
    engine = tiny_engine(cfg, params, loop)
    assert isinstance(engine.runner.params.layers, tuple) is (loop == "unroll")
    assert _greedy(engine) == expected


def test_mla_engine_on_the_latent_kernel(tiny_mla, monkeypatch):
    """The Pallas backend (interpreted here) runs the latent attention kernel: chunked prefill and batched decode
    give transformers' tokens, as the xla backend does."""
    from tests.test_engine_gemma import NEW_TOKENS, PROMPTS, _greedy, hf_greedy

    family, _, model, cfg, params = tiny_mla
    import pallas_kernels.latent_attention as latent

    traced = []
    kernel = latent.latent_paged_attention
    monkeypatch.setattr(latent, "latent_paged_attention", lambda *a, **k: traced.append(a[0].shape) or kernel(*a, **k))
    expected = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    engine = tiny_engine(cfg, params, "unroll" if family == "deepseek_v2" else "scan", backend="pallas_interpret")
    assert _greedy(engine) == expected
    assert traced, "the steps did not go through the latent attention kernel"


def test_mla_prefix_hit_equals_miss(tiny_mla):
    """A prompt whose first two pages are cached (latent entries read from the cache) gives the tokens of a cold
    engine."""
    _, _, _, cfg, params = tiny_mla
    prefix_hit_equals_miss(cfg, params)


def prefix_hit_equals_miss(cfg, params) -> None:
    """A prompt whose first two pages come from the prefix cache gives the tokens of a cold engine."""
    rng = np.random.default_rng(5)
    shared = rng.integers(2, cfg.vocab_size, 16).tolist()
    first, second = shared + rng.integers(2, cfg.vocab_size, 5).tolist(), shared + [7, 9, 11]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def run(engine, rid, prompt):
        engine.add_request(rid, prompt, greedy)
        return drain(engine)[rid]

    warm = tiny_engine(cfg, params, "unroll", prefix_caching=True)
    run(warm, "a", first)
    hit = run(warm, "b", second)
    assert hit.metrics.num_cached_tokens == 16
    miss = run(tiny_engine(cfg, params, "unroll"), "b", second)
    assert miss.metrics.num_cached_tokens == 0
    assert list(hit.outputs[0].token_ids) == list(miss.outputs[0].token_ids)


def test_mla_refusals(tiny_mla):
    family, _, _, cfg, params = tiny_mla
    d = cfg.to_hf()
    with pytest.raises(UnsupportedModelError, match="attention_bias"):
        ModelConfig.from_hf({**d, "attention_bias": True})
    if family == "deepseek_v3":
        with pytest.raises(UnsupportedModelError, match="rope_interleave"):
            ModelConfig.from_hf({**d, "rope_interleave": False})
    else:
        with pytest.raises(UnsupportedModelError, match="topk_method"):
            ModelConfig.from_hf({**d, "topk_method": "noaux_tc"})


def test_mla_weights_held_int8(tiny_mla):
    """`--quantization int8`: the latent attention's projections (the query bottleneck or query, the latent's,
    the output) held as int8 with per-channel scales: the logits of the float model holding their dequantized
    values, and not the float model's."""
    from jaxserve.models.params import declare_params
    from jaxserve.models.quantized import QuantizedWeight, dequantize, quantize_layers

    _, _, _, cfg, params = tiny_mla
    qcfg = dataclasses.replace(cfg, weight_quant="int8")
    declared = declare_params(qcfg)
    qparams = dataclasses.replace(params, layers=quantize_layers(params.layers, declared.layers),
                                  dense_layers=quantize_layers(params.dense_layers, declared.dense_layers))
    held = [f for f in ("wq", "wq_a", "wkv_a", "wo") if isinstance(getattr(qparams.layers, f), QuantizedWeight)]
    assert held == (["wq", "wq_a", "wkv_a", "wo"] if cfg.q_lora_rank else ["wq", "wkv_a", "wo"])
    ids = random_prompt()
    got = prompt_logits(qcfg, qparams, ids)
    assert rel_err(got, prompt_logits(cfg, dequantize(qparams, jnp.float32), ids)) < 1e-5
    assert rel_err(got, prompt_logits(cfg, params, ids)) > 1e-4


# DeepSeek-V3's config.json (its quantization aside).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256, "num_experts_per_tok": 8,
    "moe_intermediate_size": 2048, "n_shared_experts": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "scoring_func": "sigmoid",
    "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 1, "max_position_embeddings": 163840,
    "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32,
                     "beta_slow": 1, "original_max_position_embeddings": 4096}}


def test_released_deepseek_configs_parse():
    """DeepSeek-V2-Lite's and DeepSeek-V3's own config.json fields: 576-wide page entries (one per token and
    layer, against 2 x heads x 192 expanded), their YaRN attention scale, their routing."""
    lite = ModelConfig.from_hf({
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
        "hidden_size": 2048, "intermediate_size": 10944, "num_hidden_layers": 27, "num_attention_heads": 16,
        "num_key_value_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64, "num_experts_per_tok": 6,
        "moe_intermediate_size": 1408, "n_shared_experts": 2, "first_k_dense_replace": 1, "norm_topk_prob": False,
        "topk_method": "greedy", "n_group": 1, "topk_group": 1, "scoring_func": "softmax", "routed_scaling_factor": 1.0,
        "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000, "tie_word_embeddings": False,
        "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32,
                         "beta_slow": 1, "original_max_position_embeddings": 4096}})
    assert (lite.kv_cache_dims, lite.num_kv_heads, lite.head_dim, lite.rotary_dims) == ((576, 0), 1, 192, 64)
    assert lite.sm_scale == pytest.approx(192 ** -0.5 * (0.1 * 0.707 * np.log(40) + 1) ** 2)
    assert (lite.router_scoring, lite.expert_groups, lite.norm_topk_prob, lite.first_dense_layers) == (
        "softmax", 1, False, 1)
    assert lite.shared_expert_intermediate_size == 2 * 1408
    # bfloat16 pages of 16 tokens: 27 layers x 16 x 576 x 2 bytes (the 16 heads' expanded K and V: 16 x 320 a token).
    assert KVCache.bytes_per_page(lite, 16, jnp.bfloat16) == 27 * 16 * 576 * 2
    v3 = ModelConfig.from_hf({**DEEPSEEK_V3, "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}})
    assert (v3.kv_cache_dims, v3.q_lora_rank, v3.num_layers, v3.first_dense_layers) == ((576, 0), 1536, 61, 3)
    assert (v3.router_scoring, v3.router_bias, v3.expert_groups, v3.expert_topk_groups) == ("sigmoid", True, 8, 4)
    assert v3.sm_scale == pytest.approx(192 ** -0.5 * (0.1 * np.log(40) + 1) ** 2)


def test_mistral4_matches_transformers(tmp_path):
    """Mistral Small 4's language model: DeepSeek-V3's attention with its queries scaled by position (Llama 4's,
    past 8 positions here), softmax scores chosen in the groups with the best two-score sums, renormalized: logits
    (without the query scaling or with DeepSeek-V2's groups they are not transformers'), the checkpoint written back
    (experts packed), the config read back."""
    from safetensors.numpy import load_file

    model = save_tiny_hf("Mistral4Config", tmp_path, model_cls="Mistral4ForCausalLM", **{
        **_MLA, "q_lora_rank": 24, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 1.5,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "beta_fast": 32.0, "beta_slow": 1.0, "rope_theta": 10000.0,
                            "original_max_position_embeddings": 8, "llama_4_scaling_beta": 0.1}})
    ckpt = HFDirectory(tmp_path)
    cfg = ckpt.config()
    assert (cfg.family, cfg.router_scoring, cfg.norm_topk_prob, cfg.query_scale_beta) == ("mistral4", "softmax", True, 0.1)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    assert ModelConfig.from_hf({"architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3",
                                "text_config": model.config.to_dict()}) == cfg
    params = load_params(ckpt, cfg, jnp.float32, progress=False)
    ids = random_prompt()
    ref = hf_logits(model, ids)
    assert rel_err(prompt_logits(cfg, params, ids), ref) < REL_TOL
    assert rel_err(prompt_logits(dataclasses.replace(cfg, query_scale_beta=0.0, query_scale_length=0), params, ids),
                   ref) > 1e-3
    assert rel_err(prompt_logits(dataclasses.replace(cfg, family="deepseek_v2"), params, ids), ref) > 1e-3
    saved = {k: v for f in sorted(tmp_path.glob("*.safetensors")) for k, v in load_file(f).items()}
    written = dict(hf_tensors(cfg, {k: np.asarray(v) for k, v in param_paths(params).items()}))
    assert set(written) == set(saved)
    for name, t in written.items():
        np.testing.assert_array_equal(t, saved[name], err_msg=name)


def test_glm4_moe_lite_matches_transformers(tmp_path):
    """GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`): DeepSeek-V3's latent attention and sigmoid-routed experts, its dense
    first layer named by `mlp_layer_types`: logits, the config and the checkpoint written back."""
    from safetensors.numpy import load_file

    overrides = {k: v for k, v in _MLA.items() if k != "first_k_dense_replace"}
    model = save_tiny_hf("Glm4MoeLiteConfig", tmp_path, **overrides, q_lora_rank=24, routed_scaling_factor=1.8)
    ckpt = HFDirectory(tmp_path)
    cfg = ckpt.config()
    assert (cfg.family, cfg.first_dense_layers, cfg.q_lora_rank, cfg.router_scoring) == ("glm4_moe_lite", 1, 24,
                                                                                         "sigmoid")
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg and cfg.to_hf()["architectures"] == ["Glm4MoeLiteForCausalLM"]
    params = load_params(ckpt, cfg, jnp.float32, progress=False)
    assert rel_err(prompt_logits(cfg, params, random_prompt()), hf_logits(model, random_prompt())) < REL_TOL
    saved = {k: v for f in sorted(tmp_path.glob("*.safetensors")) for k, v in load_file(f).items()}
    written = dict(hf_tensors(cfg, {k: np.asarray(v) for k, v in param_paths(params).items()}))
    assert set(written) == set(saved)
    for name, t in written.items():
        np.testing.assert_array_equal(t, saved[name], err_msg=name)
    with pytest.raises(UnsupportedModelError, match="mlp_layer_types"):
        ModelConfig.from_hf({**cfg.to_hf(), "mlp_layer_types": ["dense", "sparse", "dense"]})


def test_kimi_k25_language_model_matches_transformers(tmp_path):
    """Kimi K2.5 (`Kimi_K25ForConditionalGeneration`) served as text: its `text_config` (Kimi K2's, DeepSeek-V3's)
    and the tensors under `model.language_model`, the MoonViT tower and projector left out: the logits of a text
    prompt. Its embeddings tie by the top-level flag (transformers' default: tied)."""
    from tests.test_model_families import TINY

    text = {**TINY, **_MLA, "model_type": "kimi_k2", "q_lora_rank": 24, "n_group": 2, "topk_group": 1,
            "tie_word_embeddings": False}
    vision = dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=48, pos_emb_height=4,
                  pos_emb_width=4)
    model = save_tiny_hf("Kimi_K25Config", tmp_path, model_cls="Kimi_K25ForConditionalGeneration", tiny=False,
                         text_config=text, vision_config=vision, projection_hidden_size=32,
                         tie_word_embeddings=False)
    # transformers writes the language model's layers back as `blocks` (its vision renames undone on every name); the
    # released checkpoints name them `language_model.model.layers.N`, as here.
    from safetensors.numpy import load_file, save_file

    for f in tmp_path.glob("*.safetensors"):
        save_file({k.replace(".model.blocks.", ".model.layers."): v for k, v in load_file(f).items()}, f)
    ckpt = HFDirectory(tmp_path)
    cfg = ckpt.config()
    assert (cfg.family, cfg.q_lora_rank, cfg.tie_word_embeddings) == ("deepseek_v3", 24, False)
    params = load_params(ckpt, cfg, jnp.float32, progress=False)
    assert rel_err(prompt_logits(cfg, params, random_prompt()), hf_logits(model, random_prompt())) < REL_TOL
    untold = {k: v for k, v in ckpt.hf_config.items() if k != "tie_word_embeddings"}
    assert ModelConfig.from_hf(untold).tie_word_embeddings
