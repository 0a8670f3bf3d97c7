"""The engine's jitted steps for a Gemma-2-shaped model, compiled for sm_90 without a GPU.

Gemma 2 2B's attention (8 query heads over 4 KV heads of 256, a 4096-key window on every other layer, logit
soft-caps 50 and 30) on five layers of a narrower model, as the engine runs them on a GPU: a loop over the
groups of a windowed and a global layer, then the fifth alone. The 256-wide heads reach the Mosaic GPU decode
kernel (split partials in bfloat16) and the warp-specialized prefill kernel inside the engine step.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import pytest

from jaxserve.config import ModelConfig
from jaxserve.engine.logprobs import PromptLogprobInputs
from jaxserve.engine.penalties import PenaltyInputs
from jaxserve.engine.runner import decode_loop, default_layer_loop, mixed_step
from jaxserve.engine.sampler import SamplingTensors
from jaxserve.models.inputs import KVCache, ModelInputs
from jaxserve.models.params import abstract_params
from tests.gpu_compile.test_compile_engine import DTYPE, RC, _abstract, _compile, decode_state, model_inputs

GEMMA2 = ModelConfig(
    family="gemma2", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=5, num_heads=8,
    num_kv_heads=4, head_dim=256, rms_norm_eps=1e-6, max_position_embeddings=8192, tie_word_embeddings=True,
    sliding_window=4096, layer_types=("sliding_attention", "full_attention") * 2 + ("sliding_attention",),
    hidden_act="gelu_pytorch_tanh",
    attn_logit_softcap=50.0, final_logit_softcap=30.0, query_pre_attn_scalar=256.0,
)
NUM_PAGES = 32768  # 16-token pages: 10.7 GB of bfloat16 K and V over the 5 layers


def _inputs(spec, S: int):
    assert default_layer_loop("pallas_mosaic") == "scan" and GEMMA2.layer_period == 2
    return model_inputs(spec, GEMMA2, NUM_PAGES, S)[:5]  # (parameters stacked, as the engine keeps them on a GPU)


POOL_BYTES = NUM_PAGES * KVCache.bytes_per_page(GEMMA2, RC.page_size, DTYPE)


@pytest.mark.gpu_compile
@pytest.mark.parametrize("backend", ["pallas", "pallas_mosaic"])
def test_gemma_steps_compile_for_sm90(spec, backend):
    T, S = RC.token_buckets[-1], RC.max_num_seqs
    params, kv, sampling, pen, want_top = _inputs(spec, S)
    host = ModelInputs.build([([0], 0, [0])], RC.page_size, num_tokens=T, num_seqs=S, pages_per_seq=RC.pages_per_seq)
    step = functools.partial(mixed_step, cfg=GEMMA2, backend=backend, top_k=RC.max_logprobs, hidden=True)
    seconds = _compile(step, params, kv, _abstract(spec, host), sampling, pen, PromptLogprobInputs(spec((T,), jnp.int32)),
                       want_top, mosaic=backend == "pallas_mosaic", triton=backend == "pallas", pool_bytes=POOL_BYTES)
    print(f"gemma2 mixed_step T={T} S={S} {backend}: compiled for sm_90 in {seconds:.1f} s")
    loop = functools.partial(decode_loop, cfg=GEMMA2, backend=backend, top_k=RC.max_logprobs,
                             n_max=RC.num_scheduler_steps)
    seconds = _compile(loop, params, kv, decode_state(spec, S), sampling, pen, want_top, mosaic=backend == "pallas_mosaic",
                       triton=backend == "pallas", pool_bytes=POOL_BYTES)
    print(f"gemma2 decode_loop S={S} {backend}: compiled for sm_90 in {seconds:.1f} s")


# Gemma 3's image-text engine step: Gemma-3-4B's attention (8 query heads over 4 KV heads of 256, windows of 1024
# keys on five layers of six, per-layer rotary bases, q/k norms) on six layers of a narrower model, with the image
# inputs a Gemma 3 engine's mixed steps carry: embeddings, their mask and each token's last visible key (an image's
# tokens attending to each other both ways), on pallas_mosaic: the warp-specialized ragged Mosaic kernel reads the
# spans from its blocks' metadata, with the generic kernel behind a cond for a crowded block.
GEMMA3 = ModelConfig.from_hf({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                              "text_config": {"hidden_size": 640, "intermediate_size": 1536, "num_hidden_layers": 6,
                                              "sliding_window": 1024, "vocab_size": 49152}})


@pytest.mark.gpu_compile
@pytest.mark.parametrize("backend", ["pallas_mosaic"])
def test_gemma3_image_step_compiles_for_sm90(spec, backend):
    import dataclasses

    import numpy as np

    assert GEMMA3.layer_types.count("full_attention") == 1 and GEMMA3.head_dim == 256
    T, S = RC.token_buckets[-1], RC.max_num_seqs
    params = _abstract(spec, abstract_params(GEMMA3, DTYPE))
    shape = (GEMMA3.num_layers, NUM_PAGES, RC.page_size, GEMMA3.num_kv_heads, GEMMA3.head_dim)
    kv = KVCache(k=spec(shape, DTYPE), v=spec(shape, DTYPE))
    sampling = _abstract(spec, SamplingTensors.from_params([], [], S, GEMMA3.vocab_size, []))
    pen = PenaltyInputs(spec((S, RC.max_model_len), jnp.int32), spec((S,), jnp.int32))
    host = ModelInputs.build([([0], 0, [0])], RC.page_size, num_tokens=T, num_seqs=S, pages_per_seq=RC.pages_per_seq)
    host = dataclasses.replace(host, image_embeds=np.zeros((T, GEMMA3.hidden_size), np.float32).astype(DTYPE),
                               image_mask=np.zeros(T, np.bool_), last_key=np.zeros(T, np.int32))
    step = functools.partial(mixed_step, cfg=GEMMA3, backend=backend, top_k=RC.max_logprobs, hidden=True)
    seconds = _compile(step, params, kv, _abstract(spec, host), sampling, pen, PromptLogprobInputs(spec((T,), jnp.int32)),
                       spec((), jnp.bool_), mosaic=backend == "pallas_mosaic", triton=True,
                       pool_bytes=NUM_PAGES * KVCache.bytes_per_page(GEMMA3, RC.page_size, DTYPE))
    print(f"gemma3 image mixed_step T={T} S={S} {backend}: compiled for sm_90 in {seconds:.1f} s")


# Gemma 4 31B's attention (32 query heads; windowed layers 16 KV heads of 256 over 1024 keys, full-attention layers 4
# KV heads of 512, keys as values, each written twice into a page row viewed as 8 heads of 512) on six layers of a
# narrower model, and 26B-A4B's experts beside the MLP (8 of 128 experts, 704 wide): the 512-wide heads reach the
# kernels inside the engine step.
GEMMA4 = ModelConfig.from_hf({
    "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "vocab_size": 65536, "hidden_size": 1024,
    "intermediate_size": 2112, "num_hidden_layers": 6, "num_attention_heads": 32, "num_key_value_heads": 16,
    "head_dim": 256, "global_head_dim": 512, "num_global_key_value_heads": 4, "attention_k_eq_v": True,
    "sliding_window": 1024, "hidden_size_per_layer_input": 0, "final_logit_softcapping": 30.0,
    "max_position_embeddings": 8192})
GEMMA4_MOE = ModelConfig.from_hf({**GEMMA4.to_hf(), "enable_moe_block": True, "num_experts": 128, "top_k_experts": 8,
                                  "moe_intermediate_size": 704})
# ... and E2B's form: 8 query heads over 1 KV head (256 wide windowed, 512 full: rows of 512), each layer's input
# embedding of 256, the last 2 of 6 layers (one of each kind) attending over earlier layers' pages, MLPs twice as
# wide.
GEMMA4_E2B = ModelConfig.from_hf({**GEMMA4.to_hf(), "num_attention_heads": 8, "num_key_value_heads": 1,
                                  "attention_k_eq_v": False, "num_global_key_value_heads": None,
                                  "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 65536,
                                  "num_kv_shared_layers": 2, "use_double_wide_mlp": True,
                                  "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2})


@pytest.mark.gpu_compile
@pytest.mark.parametrize("backend,form", [("pallas", "31b"), ("pallas", "moe"), ("pallas", "e2b")])
def test_gemma4_mixed_step_compiles_for_sm90(spec, backend, form):
    cfg = {"31b": GEMMA4, "moe": GEMMA4_MOE, "e2b": GEMMA4_E2B}[form]
    assert cfg.gemma4.head_dim == 512 and cfg.num_dense_layers == cfg.num_layers // cfg.layer_period
    T, S = RC.token_buckets[-1], RC.max_num_seqs
    params = _abstract(spec, abstract_params(cfg, DTYPE))
    pages = 8192
    shape = (len(cfg.attention_layers), pages, RC.page_size, cfg.kv_pool_heads, cfg.head_dim)
    kv = KVCache(k=spec(shape, DTYPE), v=spec(shape, DTYPE))
    sampling = _abstract(spec, SamplingTensors.from_params([], [], S, cfg.vocab_size, []))
    pen = PenaltyInputs(spec((S, RC.max_model_len), jnp.int32), spec((S,), jnp.int32))
    host = ModelInputs.build([([0], 0, [0])], RC.page_size, num_tokens=T, num_seqs=S, pages_per_seq=RC.pages_per_seq)
    step = functools.partial(mixed_step, cfg=cfg, backend=backend, top_k=RC.max_logprobs, hidden=True)
    seconds = _compile(step, params, kv, _abstract(spec, host), sampling, pen, PromptLogprobInputs(spec((T,), jnp.int32)),
                       spec((), jnp.bool_), triton=True,
                       pool_bytes=pages * KVCache.bytes_per_page(cfg, RC.page_size, DTYPE))
    print(f"gemma4 {form} mixed_step T={T} S={S} {backend}: compiled for sm_90 in {seconds:.1f} s")
    if form != "31b":  # (the decode loop once: its 512-wide heads on the generic kernel, as `pallas_mosaic` too)
        return
    loop = functools.partial(decode_loop, cfg=cfg, backend=backend, top_k=RC.max_logprobs,
                             n_max=RC.num_scheduler_steps)
    seconds = _compile(loop, params, kv, decode_state(spec, S), sampling, pen, spec((), jnp.bool_),
                       triton=True, pool_bytes=pages * KVCache.bytes_per_page(cfg, RC.page_size, DTYPE))
    print(f"gemma4 {form} decode_loop S={S} {backend}: compiled for sm_90 in {seconds:.1f} s")


@pytest.mark.gpu_compile
def test_gemma4_vision_tower_compiles_for_sm90(spec):
    """Gemma 4's vision tower and projection at its released shapes (16 blocks of 768, 12 heads of 64, clamped
    projections, standardized; 2520 patches: 280 soft tokens into a 5376-wide language model), as the engine runs
    every image: padded to the processor's most patches."""
    from jaxserve.models.vision_gemma4 import Gemma4VisionConfig, Gemma4VisionParams, gemma4_encode

    cfg = Gemma4VisionConfig.from_hf({"architectures": ["Gemma4ForConditionalGeneration"], "text_config":
                                      {"hidden_size": 5376, "use_bidirectional_attention": "vision"},
                                      "vision_config": {"use_clipped_linears": True, "standardize": True}})
    L, H, F, q = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim
    shapes = dict(q_proj=(L, H, q), k_proj=(L, H, q), v_proj=(L, H, q), o_proj=(L, q, H), gate_proj=(L, H, F),
                  up_proj=(L, H, F), down_proj=(L, F, H), attn_norm=(L, H), post_attn_norm=(L, H), mlp_norm=(L, H),
                  post_mlp_norm=(L, H), q_norm=(L, cfg.head_dim), k_norm=(L, cfg.head_dim))
    layers = {k: spec(s, DTYPE) for k, s in shapes.items()} | {"clips": spec((L, 7, 4), jnp.float32)}
    params = Gemma4VisionParams(patch=spec((cfg.patch_dim, H), DTYPE),
                                positions=spec((2, cfg.position_embedding_size, H), DTYPE), layers=layers,
                                proj=spec((H, cfg.text_hidden_size), DTYPE), std=spec((2, H), jnp.float32))
    N = 280 * cfg.pooling ** 2
    def fn(p, patches, positions):
        return gemma4_encode(p, cfg, patches, positions)

    seconds = _compile(fn, params, spec((N, cfg.patch_dim), jnp.float32), spec((N, 2), jnp.int32), donate=(),
                       triton=False)
    print(f"gemma4 vision tower {N} patches: compiled for sm_90 in {seconds:.1f} s")
