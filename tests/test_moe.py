"""Mixture-of-experts families against HF transformers (tiny random models made locally), the key
map's refusals for expert tensors, and expert parallelism on 8 simulated CPU devices."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxserve.config import ModelConfig, UnsupportedModelError  # noqa: E402
from jaxserve.loader import CheckpointError, HFDirectory, load_params  # noqa: E402
from jaxserve.loader.assembler import WeightAssembler  # noqa: E402
from jaxserve.loader.keymap import hf_names  # noqa: E402
from jaxserve.models.moe import local_experts, route  # noqa: E402
from pallas_kernels.grouped_matmul import grouped_matmul  # noqa: E402
from tests.test_model_families import (  # noqa: E402
    hf_logits,
    ours_logits,
    prompt_logits,
    random_prompt,
    rel_err,
    save_tiny_hf,
)
from tests.test_sharding_worker import moe_config, run_cases  # noqa: E402

REL_TOL = 1e-4
MOE = dict(num_experts_per_tok=2)
FAMILIES = {
    # Mixtral: softmax, top-2, renormalized; experts as wide as the dense MLP.
    "mixtral": ("MixtralConfig", {**MOE, "num_local_experts": 4, "intermediate_size": 48}),
    # Qwen2-MoE: no renormalization, plus a sigmoid-gated shared expert; q/k/v biases.
    "qwen2_moe": ("Qwen2MoeConfig", {**MOE, "num_experts": 8, "moe_intermediate_size": 32,
                                     "shared_expert_intermediate_size": 40, "norm_topk_prob": False}),
    # Granite MoE: a softmax over the top-k logits, experts fused in one tensor per kind, Granite's scalars.
    "granitemoe": ("GraniteMoeConfig", {**MOE, "num_local_experts": 4, "intermediate_size": 48,
                                        "embedding_multiplier": 12.0, "attention_multiplier": 0.125,
                                        "residual_multiplier": 0.22, "logits_scaling": 8.0}),
    # Granite MoE with an ungated shared expert (its `shared_mlp`: gate and up in one tensor).
    "granitemoeshared": ("GraniteMoeSharedConfig", {**MOE, "num_local_experts": 4, "intermediate_size": 48,
                                                    "shared_intermediate_size": 40, "residual_multiplier": 0.22,
                                                    "logits_scaling": 8.0}),
    # Granite 4.0's hybrid of attention layers only, experts and a shared expert, no rotary embedding (NoPE).
    "granitemoehybrid": ("GraniteMoeHybridConfig", {**MOE, "num_local_experts": 4, "intermediate_size": 48,
                                                    "shared_intermediate_size": 40, "embedding_multiplier": 12.0,
                                                    "attention_multiplier": 0.125, "layer_types": ["attention"] * 2,
                                                    "position_embedding_type": None}),
    # Qwen3-MoE: renormalized top-k, q/k norms, no shared expert.
    "qwen3_moe": ("Qwen3MoeConfig", {**MOE, "num_experts": 8, "moe_intermediate_size": 32,
                                     "norm_topk_prob": True, "head_dim": 16}),
    # GLM-4.5: sigmoid scores with a bias for choosing, experts in 2 groups of which 1 is chosen, weights scaled
    # by 2.5, an ungated shared expert, a dense first layer, q/k/v biases, half the head's dims rotated.
    "glm4_moe": ("Glm4MoeConfig", {**MOE, "n_routed_experts": 8, "moe_intermediate_size": 32, "n_shared_experts": 1,
                                   "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
                                   "routed_scaling_factor": 2.5, "attention_bias": True, "num_hidden_layers": 3,
                                   "head_dim": 16}),
    # dots.llm1: Qwen3's attention (q/k norms), DeepSeek-V3's experts (as GLM-4.5's, not renormalized here).
    "dots1": ("Dots1Config", {**MOE, "n_routed_experts": 8, "moe_intermediate_size": 32, "n_shared_experts": 2,
                              "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1, "routed_scaling_factor": 1.5,
                              "num_hidden_layers": 3, "head_dim": 16}),
    # ERNIE 4.5: softmax scores with a bias for choosing, an ungated shared expert, a dense first layer,
    # interleaved rotary pairs over the whole head.
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", {"moe_num_experts": 8, "moe_k": 2, "moe_intermediate_size": 32,
                                            "moe_num_shared_experts": 1, "moe_layer_start_index": 1,
                                            "num_hidden_layers": 3, "head_dim": 16}),
    # OLMoE: q and k normed over all their heads (OLMo's), softmax top-k not renormalized.
    "olmoe": ("OlmoeConfig", {**MOE, "num_experts": 8, "intermediate_size": 32, "norm_topk_prob": False,
                              "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    # FlexOlmo: OLMo 2's layers (norms after attention and the MLP only, q and k normed over all their heads) with
    # OLMoE's experts.
    "flex_olmo": ("FlexOlmoConfig", {**MOE, "num_experts": 8, "intermediate_size": 32, "norm_topk_prob": False,
                                     "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    # gpt-oss: attention sinks, every other layer windowed (8 of the 40-token prompt), YaRN unrounded; a biased
    # router (top-k logits softmaxed) and biased experts packed input-major, gate and up columns interleaved, their
    # SwiGLU clamped at 1.0 (the random weights cross it).
    "gpt_oss": ("GptOssConfig", {**MOE, "num_local_experts": 4, "intermediate_size": 32, "head_dim": 16,
                                 "sliding_window": 8, "swiglu_limit": 1.0, "num_hidden_layers": 3,
                                 "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                     "beta_slow": 1.0, "truncate": False, "rope_theta": 10000.0,
                                                     "original_max_position_embeddings": 64}}),
    # Hy3: read as dots.llm1 (its modules renamed), a dense first layer (its mlp_layer_types), one group of experts.
    "hy_v3": ("HYV3Config", {**MOE, "num_experts": 8, "moe_intermediate_size": 32, "num_shared_experts": 1,
                             "router_scaling_factor": 2.5, "head_dim": 16, "num_hidden_layers": 3}),
    # MiniMax-M2: q and k normed over all their heads, the first half of each head rotated (its released configs'
    # `rotary_dim`); sigmoid scores with a bias for choosing, renormalized; Mixtral's tensor names.
    "minimax_m2": ("MiniMaxM2Config", {**MOE, "num_local_experts": 8, "intermediate_size": 32, "head_dim": 16,
                                       "rotary_dim": 8}),
}


def _experts(family: str) -> int:
    o = FAMILIES[family][1]
    return o.get("num_local_experts") or o.get("num_experts") or o.get("n_routed_experts") or o["moe_num_experts"]


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny_moe(request, tmp_path_factory):
    cls, overrides = FAMILIES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    model = save_tiny_hf(cls, path, **overrides)
    return request.param, path, model


def test_moe_logits_match_transformers(tiny_moe):
    family, path, model = tiny_moe
    ids = random_prompt()
    ours, cfg = ours_logits(path, ids)
    assert cfg.family == {"hy_v3": "dots1"}.get(family, family) and cfg.num_experts == _experts(family)
    ref = hf_logits(model, ids)
    assert rel_err(ours, ref) < REL_TOL
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() > 0.97


def test_moe_config_parsing_per_family(tiny_moe):
    family, path, _ = tiny_moe
    cfg = HFDirectory(path).config()
    assert cfg.norm_topk_prob is (family not in ("qwen2_moe", "dots1", "olmoe", "flex_olmo"))
    assert cfg.output_norms is (family == "flex_olmo") and cfg.input_norms is (family != "flex_olmo")
    o = FAMILIES[family][1]
    shared = o.get("n_shared_experts", o.get("moe_num_shared_experts", o.get("num_shared_experts", 0))) * o.get(
        "moe_intermediate_size", 0)
    assert cfg.shared_expert_intermediate_size == o.get("shared_expert_intermediate_size", o.get(
        "shared_intermediate_size", shared))
    assert cfg.moe_intermediate_size == o.get("moe_intermediate_size", o.get("intermediate_size"))
    assert (cfg.first_dense_layers, cfg.router_scoring, cfg.router_bias) == {
        "glm4_moe": (1, "sigmoid", True), "dots1": (1, "sigmoid", True), "ernie4_5_moe": (1, "softmax", True),
        "minimax_m2": (0, "sigmoid", True), "hy_v3": (1, "sigmoid", True)}.get(
        family, (0, "softmax", False))
    assert (cfg.no_rope_layers == (0, 0)) is (family == "granitemoehybrid")
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


def test_moe_refuses_dense_layers_between_moe_layers():
    d = {"architectures": ["Qwen2MoeForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_experts": 4, "num_experts_per_tok": 2,
         "moe_intermediate_size": 16, "decoder_sparse_step": 2}
    with pytest.raises(UnsupportedModelError, match="dense layers between the MoE layers"):
        ModelConfig.from_hf(d)


def test_keymap_refuses_out_of_range_expert_and_missing_experts():
    cfg = moe_config("qwen3_moe")
    asm = WeightAssembler(cfg, np.float32)
    with pytest.raises(CheckpointError, match="names expert 8, but the model has 8 experts"):
        asm.add("model.layers.0.mlp.experts.8.up_proj.weight", np.zeros((32, 64), np.float32))
    with pytest.raises(CheckpointError, match=r"shape \(64, 32\), expected \(32, 64\)"):
        asm.add("model.layers.0.mlp.experts.1.up_proj.weight", np.zeros((64, 32), np.float32))
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in asm.missing()


def test_dispatch_equals_dense_computation_and_drops_no_token():
    """Every token reaches its k experts, even when all tokens pick the same ones (no capacity limit)."""
    cfg = moe_config("qwen3_moe")
    key = jax.random.PRNGKey(3)
    T, E, X, Fe = 24, cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    ks = jax.random.split(key, 5)
    h = jax.random.normal(ks[0], (T, E))
    router = jax.random.normal(ks[1], (E, X)).at[:, :2].add(50.0)  # every token prefers experts 0 and 1
    wg, wu = (0.1 * jax.random.normal(k, (X, E, Fe)) for k in ks[2:4])
    wd = 0.1 * jax.random.normal(ks[4], (X, Fe, E))
    weights, experts = route(h, router, cfg)
    got = np.asarray(local_experts(h, weights, experts, wg, wu, wd, 0, cfg))
    dense = np.zeros((T, E))
    for t in range(T):
        for j in range(cfg.num_experts_per_tok):
            x = int(experts[t, j])
            y = (jax.nn.silu(h[t] @ wg[x]) * (h[t] @ wu[x])) @ wd[x]
            dense[t] += float(weights[t, j]) * np.asarray(y)
    assert np.allclose(got, dense, rtol=1e-5, atol=1e-5)
    # Split over 4 "devices" of 2 experts each, the partial outputs sum to the whole; so with the Pallas grouped
    # matmul (interpreted) as the experts' matmuls.
    kernel = functools.partial(grouped_matmul, interpret=True)
    assert np.allclose(local_experts(h, weights, experts, wg, wu, wd, 0, cfg, matmul=kernel), dense, atol=1e-5)
    for matmul in (None, kernel):
        parts = sum(np.asarray(local_experts(h, weights, experts, wg[i:i + 2], wu[i:i + 2], wd[i:i + 2], i, cfg,
                                             matmul=matmul)) for i in range(0, X, 2))
        assert np.allclose(parts, got, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [2, 8, 24])
def test_grouped_matmul_equals_each_rows_own_expert(rows):
    """Rows sorted by group, each times its group's matrix: gathered per row (the CPU's form at no more rows than
    groups) or as a ragged dot (more), float or int8 with per-channel scales; a row past the groups (an expert on
    another device) is left to the caller."""
    from jaxserve.models.quantized import grouped, quantize

    G, K, N = 8, 32, 24
    ks = jax.random.split(jax.random.PRNGKey(7), 3)
    x = jax.random.normal(ks[0], (rows, K))
    w = jax.random.normal(ks[1], (G, K, N))
    row_group = jnp.sort(jax.random.randint(ks[2], (rows,), 0, G + 1))  # (G: a row routed elsewhere, sorted last)
    sizes = jnp.bincount(row_group, length=G + 1)[:G].astype(jnp.int32)
    inside = np.asarray(row_group) < G
    want = np.einsum("rk,rkn->rn", np.asarray(x), np.asarray(w)[np.minimum(np.asarray(row_group), G - 1)])
    got = np.asarray(jax.jit(grouped)(x, w, sizes, row_group))
    np.testing.assert_allclose(got[inside], want[inside], rtol=1e-5, atol=1e-5)
    qw = quantize(w, jnp.int8, (1,))
    deq = np.asarray(qw.q, np.float32) * np.asarray(qw.scale)
    want_q = np.einsum("rk,rkn->rn", np.asarray(x), deq[np.minimum(np.asarray(row_group), G - 1)])
    got_q = np.asarray(jax.jit(grouped)(x, qw, sizes, row_group))
    np.testing.assert_allclose(got_q[inside], want_q[inside], rtol=1e-4, atol=1e-4)


def test_loaded_moe_params_have_experts_stacked(tiny_moe):
    family, path, model = tiny_moe
    ckpt = HFDirectory(path)
    cfg = ckpt.config()
    params = load_params(ckpt, cfg, jnp.float32, progress=False)
    assert params.layers.w_gate is None
    dense = cfg.first_dense_layers  # GLM-4.5's first layer: a dense MLP, stacked apart
    assert params.layers.we_gate.shape == (cfg.num_layers - dense, cfg.num_experts, cfg.hidden_size,
                                           cfg.moe_intermediate_size)
    assert (params.dense_layers is not None) is (family in ("glm4_moe", "ernie4_5_moe", "dots1", "hy_v3"))
    if dense:
        assert params.dense_layers.we_gate is None
        assert params.dense_layers.w_gate.shape == (dense, cfg.hidden_size, cfg.intermediate_size)
        assert params.layers.router_bias.dtype == jnp.float32 and np.abs(params.layers.router_bias).max() > 0
    assert (params.layers.ws_gate is not None) is (family in ("qwen2_moe", "granitemoeshared", "granitemoehybrid",
                                                              "glm4_moe", "ernie4_5_moe", "dots1", "hy_v3"))
    assert (params.layers.ws_mix is not None) is (family == "qwen2_moe")  # only Qwen's shared expert is gated
    if family in ("olmoe", "flex_olmo"):  # (FlexOlmo's post norms and OLMoE's experts under their own names)
        from tests.test_model_families import assert_written_back

        assert_written_back(path, cfg, params)
        assert ModelConfig.from_hf(cfg.to_hf()) == cfg


# -- expert parallel on 8 simulated devices --------------------------------------------------------------

@pytest.fixture(scope="module")
def ep_results() -> dict:
    r = run_cases("moe", "engine_moe")
    return {**r["moe"], "engine": r["engine_moe"]}


@pytest.mark.parametrize("tp,ep", [(1, 4), (2, 2)])
def test_ep_logits_equal_unsharded(ep_results, tp, ep):
    r = ep_results[f"tp{tp}_ep{ep}"]
    assert r["num_devices"] == tp * ep
    assert r["rel_prefill"] < 1e-5 and r["rel_decode"] < 1e-5
    assert r["argmax_equal"]
    # Each device holds only its experts, and only its slice of their width.
    assert r["experts_per_device"] == 8 // ep
    assert r["expert_width_per_device"] == 32 // tp


def test_ep_qwen3_moe_equals_unsharded(ep_results):
    r = ep_results["qwen3_tp1_ep4"]
    assert r["rel_prefill"] < 1e-5 and r["rel_decode"] < 1e-5 and r["experts_per_device"] == 2


def test_ep_glm4_moe_equals_unsharded(ep_results):
    """GLM-4.5's dense first layer (stacked apart, split by TP) and its MoE layers (sigmoid routing, router bias)
    under EP=2 x TP=2."""
    r = ep_results["glm4_tp2_ep2"]
    assert r["rel_prefill"] < 1e-5 and r["rel_decode"] < 1e-5 and r["argmax_equal"] and r["experts_per_device"] == 4
    assert r["dense_mlp_per_device"] == 128 // 2


def test_ep_gpt_oss_equals_unsharded(ep_results):
    """gpt-oss under EP=2 x TP=2: the sinks split with the heads, the experts' biases with the experts and their
    width, the down projection's bias added by one slice of the width only."""
    r = ep_results["gpt_oss_tp2_ep2"]
    assert r["rel_prefill"] < 1e-5 and r["rel_decode"] < 1e-5 and r["argmax_equal"] and r["experts_per_device"] == 4


def test_ep_deepseek_v3_latent_attention_equals_unsharded(ep_results):
    """DeepSeek-V3's latent attention under EP=2 x TP=2: the query heads and the up-projections split, the one
    latent per token copied to each device's pages."""
    r = ep_results["mla_tp2_ep2"]
    assert r["rel_prefill"] < 1e-5 and r["rel_decode"] < 1e-5 and r["argmax_equal"] and r["experts_per_device"] == 4
    assert (r["kv_repeat"], r["kv_shard_heads"], r["wq_shard_heads"]) == (2, 1, 2)


def test_ep_deepseek_v32_sparse_attention_equals_unsharded(ep_results):
    """DeepSeek-V3.2's sparse attention under EP=2 x TP=2: the indexer whole on each device, its keys in each
    device's copy of the entries, the query heads split."""
    r = ep_results["dsa_tp2_ep2"]
    assert r["rel_prefill"] < 1e-5 and r["rel_decode"] < 1e-5 and r["argmax_equal"] and r["experts_per_device"] == 4
    assert (r["kv_repeat"], r["kv_shard_heads"], r["wq_shard_heads"]) == (2, 1, 2)


def test_ep_cohere2_moe_equals_unsharded(ep_results):
    """Command A MoE's layers under EP=2 x TP=2: the experts and the shared expert (averaged with them) reading the
    attention's normed input, the dense first layer's MLP split as a dense model's."""
    r = ep_results["cohere2_moe_tp2_ep2"]
    assert r["rel_prefill"] < 1e-5 and r["rel_decode"] < 1e-5 and r["argmax_equal"]
    assert (r["experts_per_device"], r["dense_mlp_per_device"]) == (4, 48)


def test_ep_llama4_maverick_dense_and_moe_layers_equal_unsharded(ep_results):
    """Llama 4 Maverick's layers under EP=2 x TP=2: its dense layers' MLP split as a dense model's, the MoE layers'
    experts over the expert axis."""
    r = ep_results["maverick_tp2_ep2"]
    assert r["rel_prefill"] < 1e-5 and r["rel_decode"] < 1e-5 and r["argmax_equal"]
    assert (r["experts_per_device"], r["dense_mlp_per_device"]) == (2, 24)


@pytest.mark.parametrize("name", ["pallas_gpt_oss", "pallas_mla", "pallas_dsa"])
def test_ep_kernels_on_each_devices_heads_equal_unsharded(ep_results, name):
    """The Pallas kernels (interpreted) at EP=2 x TP=2, each device on its own heads: gpt-oss's sinks split with
    them, DeepSeek-V3's latent attention kernel on each device's copy of the latents, the sparse latent kernel (of a
    GLM-5.2-like model, its second layer reusing the first's choice) on each device's copy of the entries, with the
    slots its indexer kernel chose over that copy."""
    r = ep_results[f"{name}_tp2_ep2"]
    assert r["rel_prefill"] < 1e-5 and r["rel_decode"] < 1e-5 and r["argmax_equal"] and r["wq_shard_heads"] == 2


def test_ep2_tp2_engine_greedy_is_token_identical_and_never_recompiles(ep_results):
    r = ep_results["engine"]
    assert r["devices"] == 4
    assert all(len(t) == 12 for t in r["ref"])
    assert r["ep"] == r["ref"]
    assert r["compiles_after_warmup"] == 0
    # A LoRA adapter on the attention: the same tokens at EP=2 x TP=2 as on one device, and not the base's.
    assert r["lora_ep"] == r["lora_ref"] and r["lora_ref"] != r["ref"]
    assert r["lora_compiles_after_warmup"] == 0
    # vLLM's --enable-expert-parallel at TP=2: each device holds half of the experts, whole; the same tokens.
    whole = r["whole_experts"]
    assert whole["tokens"] == r["ref"] and whole["compiles_after_warmup"] == 0
    assert (whole["experts_per_device"], whole["width_per_device"]) == (8 // 2, 32)
    # DeepSeek-V3's latent attention with an adapter on its projections, kv_b_proj, router and experts: the same.
    assert r["mla_lora_ep"] == r["mla_lora_ref"] != r["mla_lora_base"]


@pytest.mark.parametrize("family", ["glm4_moe", "ernie4_5_moe", "dots1"])
def test_dense_first_layers_engine_greedy_equals_transformers(tmp_path, family):
    """GLM-4.5 and ERNIE 4.5 MoE through the engine, their dense first layer and their MoE layers unrolled (the
    CPU's default: one tuple of every layer) and scanned (two stacks), chunked and batched: transformers' greedy
    tokens."""
    from tests.test_engine_gemma import _greedy, engines_by_layer_loop

    for loop, engine, expected in engines_by_layer_loop(tmp_path, *FAMILIES[family]):
        assert isinstance(engine.runner.params.layers, tuple) is (loop == "unroll")
        assert _greedy(engine) == expected, loop


def test_gpt_oss_engine_greedy_equals_transformers(tmp_path):
    """gpt-oss through the engine (attention sinks, windowed and global layers, biased experts), unrolled and as
    groups of a windowed and a global layer, chunked and batched: transformers' greedy tokens."""
    from tests.test_engine_gemma import _greedy, engines_by_layer_loop

    for loop, engine, expected in engines_by_layer_loop(tmp_path, *FAMILIES["gpt_oss"]):
        assert _greedy(engine) == expected, loop


def test_gpt_oss_mxfp4_checkpoint_reads_as_its_dequantized_weights(tmp_path):
    """gpt-oss's released checkpoints hold the experts in MXFP4 (`*_blocks` and `*_scales`, quant_method "mxfp4"):
    read dequantized, they give transformers' logits of the model holding the weights that transformers' own
    converter dequantizes them to."""
    import dataclasses
    import json

    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model = save_tiny_hf(FAMILIES["gpt_oss"][0], tmp_path, **FAMILIES["gpt_oss"][1])
    tensors = load_file(tmp_path / "model.safetensors")
    rng = np.random.default_rng(0)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        X, K, N = tensors.pop(name).shape
        blocks = rng.integers(0, 256, (X, N, K // 32, 16), dtype=np.uint8)
        scales = rng.integers(121, 126, (X, N, K // 32), dtype=np.uint8)  # 2^-6 to 2^-2
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        with torch.no_grad():
            model.get_parameter(name).copy_(convert_moe_packed_tensors(
                torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32))
    save_file(tensors, tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ids = random_prompt()
    ours, cfg = ours_logits(tmp_path, ids)
    assert rel_err(ours, hf_logits(model, ids)) < REL_TOL
    # Held as int8 experts instead, each dequantized, then quantized on the host as it loads (gpt-oss-120b on one
    # GPU): the same model as the dequantized one quantized once loaded, as an unquantized checkpoint's would be.
    from jaxserve.engine.model_loading import check_quantization, quantize_model
    from jaxserve.models.quantized import QuantizedWeight
    assert check_quantization("experts_int8", str(tmp_path), config, cfg) == ("experts_int8", None)
    held = dataclasses.replace(cfg, weight_quant="experts_int8")
    params = load_params(HFDirectory(tmp_path), held, jnp.float32, progress=False)
    assert isinstance(params.layers.we_gate, QuantizedWeight) and params.layers.we_gate.q.dtype == jnp.int8
    after, after_cfg, _ = quantize_model(load_params(HFDirectory(tmp_path), cfg, jnp.float32, progress=False), cfg,
                                         None, "experts_int8")
    got = prompt_logits(held, params, ids)
    np.testing.assert_allclose(got, prompt_logits(after_cfg, after, ids), rtol=1e-5, atol=1e-5)
    assert rel_err(got, ours) > 1e-3  # (int8 experts, not the float ones)
    save_file({k: v for k, v in tensors.items() if not k.endswith("0.mlp.experts.down_proj_scales")},
              tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="quantized weight model.layers.0.mlp.experts.down_proj is missing "
                                              "model.layers.0.mlp.experts.down_proj_scales"):
        ours_logits(tmp_path, ids)


def test_multi_token_prediction_tensors_are_not_read():
    """GLM-4.5's checkpoints carry its multi-token prediction module as one more layer (`model.layers.{L}`), ERNIE
    4.5's under `model.mtp*`: the model reads past them. Another family's tensor of such a layer is refused by
    name."""
    from jaxserve.config import ModelConfig

    cfg = moe_config("qwen3_moe")
    L = cfg.num_layers
    with pytest.raises(CheckpointError, match=f"names layer {L}, but the model has {L} layers"):
        WeightAssembler(cfg, np.float32).add(f"model.layers.{L}.mlp.gate.weight", np.zeros((8, 64), np.float32))
    glm = moe_config("glm4_moe")
    ernie = ModelConfig.from_hf({"architectures": ["Ernie4_5_MoeForCausalLM"], "vocab_size": 64, "hidden_size": 64,
                                 "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
                                 "num_key_value_heads": 2, "head_dim": 16, "moe_num_experts": 8, "moe_k": 2,
                                 "moe_intermediate_size": 32, "moe_num_shared_experts": 1})
    for cfg, names in ((glm, [f"model.layers.{glm.num_layers}.{rest}" for rest in (
            "eh_proj.weight", "mlp.gate.weight", "shared_head.head.weight")]),
                       (ernie, ["model.mtp_block.0.input_layernorm.weight", "model.mtp_emb_norm.0.weight",
                                "model.mtp_linear_proj.0.weight", "model.mtp.eh_proj.weight"])):
        asm = WeightAssembler(cfg, np.float32)
        for name in names:
            asm.add(name, np.zeros((3, 3), np.float32))
        assert len(asm.missing()) == len(hf_names(cfg))  # nothing taken
        with pytest.raises(CheckpointError, match=f"unknown tensor 'model.layers.0.mlp.gate.weight' for a {cfg.family}"):
            asm.add("model.layers.0.mlp.gate.weight", np.zeros((8, 64), np.float32))  # layer 0 is dense


def test_sigmoid_routing_chooses_within_the_best_groups():
    """DeepSeek-V3's choice: by score plus bias, only among the experts of the best groups (each group ranked by
    the sum of its two best); the weights are the chosen experts' scores, renormalized, times the scale."""
    import dataclasses

    cfg = dataclasses.replace(moe_config("qwen3_moe"), router_scoring="sigmoid", expert_groups=4,
                              expert_topk_groups=2, routed_scaling_factor=2.0)
    E, X = cfg.hidden_size, cfg.num_experts
    h = np.zeros((1, E), np.float32)
    h[0, 0] = 1.0
    logits = np.array([3.0, -3.0, 0.5, 0.4, 2.5, 2.4, -1.0, -2.0], np.float32)  # groups {0,1} {2,3} {4,5} {6,7}
    router = np.zeros((E, X), np.float32)
    router[0] = logits
    bias = np.zeros(X, np.float32)
    weights, experts = route(jnp.asarray(h), jnp.asarray(router), cfg, jnp.asarray(bias))
    # Group sums: {0,1} 0.95 + 0.05, {2,3} 0.62 + 0.60, {4,5} 0.92 + 0.92: groups {2,3} and {4,5} win, and
    # expert 0 (the best score) is left out with its group.
    assert sorted(np.asarray(experts)[0].tolist()) == [4, 5]
    s = 1 / (1 + np.exp(-logits))
    np.testing.assert_allclose(np.sort(np.asarray(weights)[0]), np.sort(2.0 * s[[4, 5]] / s[[4, 5]].sum()), rtol=1e-6)
    bias[2] = 1.0  # the bias moves expert 2 (and its group) into the choice; its weight stays its own score
    weights, experts = route(jnp.asarray(h), jnp.asarray(router), cfg, jnp.asarray(bias))
    chosen = np.asarray(experts)[0].tolist()
    assert 2 in chosen and 0 not in chosen
    np.testing.assert_allclose(np.asarray(weights)[0].sum(), 2.0, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(weights)[0][chosen.index(2)], 2.0 * s[2] / s[chosen].sum(), rtol=1e-6)


def test_moe_runner_backend_picks_the_experts_matmul(tmp_path, monkeypatch):
    """`--moe-runner-backend`: pallas runs the experts on the grouped-matmul kernel (its interpreter on the CPU) under
    the xla attention backend, xla keeps ragged_dot under a Pallas one; either way transformers' greedy tokens."""
    import argparse

    import jaxserve.models.moe as moe
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine_args import EngineArgs
    from tests.test_engine_gemma import _greedy, engines_by_layer_loop

    calls = []
    real = moe.grouped_matmul
    monkeypatch.setattr(moe, "grouped_matmul", lambda *a, **k: calls.append(k["interpret"]) or real(*a, **k))
    _, engine, expected = next(engines_by_layer_loop(tmp_path, *FAMILIES["qwen3_moe"]))
    assert _greedy(engine) == expected and calls == []  # auto under xla: ragged_dot
    loaded = dataclasses.replace(engine.model, params=engine.runner.params)
    for runner, backend, kernel in (("pallas", "xla", True), ("xla", "pallas_interpret", False)):
        args = dataclasses.replace(engine.args, moe_runner_backend=runner, attention_backend=backend)
        other = LLMEngine(args, loaded=loaded, progress=False)
        assert other.model.config.moe_runner == runner
        assert _greedy(other) == expected and bool(calls) is kernel and all(calls), runner
        calls.clear()
    ns = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(["--moe-runner-backend", "pallas"])
    assert EngineArgs.from_cli_args(ns).moe_runner_backend == "pallas"
    with pytest.raises(ValueError, match="moe_runner_backend must be one of auto, xla, pallas"):
        EngineArgs(moe_runner_backend="triton")
