"""A hybrid model's steps (Granite 4.0-H: Mamba-2 layers beside attention), compiled for sm_90 without a GPU.

Granite-4.0-H-Tiny's shapes (48 Mamba heads of 64 channels, a state of 128 per channel; 12 query and 4 KV heads)
cut to a Mamba layer, an attention layer and a Mamba layer, dense, at the default engine's buckets: the mixed step
in the largest token bucket (the scan over its tokens, each sequence from its slot's state) and the decode loop in
the largest sequence bucket (every row's state stepped at once). The page pool and the state pools are updated in
place. The mixed step too of Nemotron 3 Nano's blocks (Mamba + MoE of ungated experts, a Mamba block alone,
attention + MoE; 16 of its 128 experts, as tests/gpu_compile/test_compile_moe_lora.py cuts Qwen3-MoE's, the
temporaries then under the 1 GB the engine tests allow), of LFM3-1.7B's layers (LFM2's short convolutions: a
convolution state alone, no SSM state; windowed and full attention, each head's output gated), of Qwen3-Next's (Gated DeltaNet layers, gated attention; 16 of its 512 experts), of
OLMo Hybrid's (DeltaNet layers normed before, attention normed after), of Falcon-H1's (each layer's mixer beside
its attention) and of Jamba's (Mamba layers of the selective scan, an associative scan a chunk; experts every other
layer).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp
import pytest

from jaxserve.config import ModelConfig
from jaxserve.engine.logprobs import PromptLogprobInputs
from jaxserve.engine.runner import decode_loop, mixed_step
from jaxserve.engine.sampler import SamplingTensors
from jaxserve.models.inputs import KVCache, ModelInputs
from tests.gpu_compile.test_compile_engine import DTYPE, RC, _abstract, _common, _compile, decode_state

GRANITE_H = ModelConfig.from_hf({
    "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid", "vocab_size": 100352,
    "hidden_size": 1536, "num_hidden_layers": 3, "num_attention_heads": 12, "num_key_value_heads": 4,
    "num_local_experts": 0, "shared_intermediate_size": 1024, "layer_types": ["mamba", "attention", "mamba"],
    "mamba_n_heads": 48, "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1, "mamba_expand": 2,
    "mamba_d_conv": 4, "max_position_embeddings": 131072, "tie_word_embeddings": True,
    "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.0078125,
    "logits_scaling": 6.0})
NEMOTRON_3 = ModelConfig.from_hf({
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": 131072, "hidden_size": 2688,
    "hybrid_override_pattern": "MEM*E", "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128,
    "mamba_num_heads": 64, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4,
    "n_routed_experts": 16, "num_experts_per_tok": 6, "moe_intermediate_size": 1856,
    "moe_shared_expert_intermediate_size": 3712, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5,
    "max_position_embeddings": 262144})
# LFM3-1.7B's shapes (LFM2's short convolutions, 7 taps; windowed and full attention, 16 heads of 128 over 4 KV
# heads, each head's output gated), its layers cut to a convolution, a windowed and a full attention layer.
LFM3 = ModelConfig.from_hf({
    "architectures": ["Lfm3ForCausalLM"], "model_type": "lfm3", "vocab_size": 128000, "hidden_size": 2048,
    "num_hidden_layers": 3, "layer_types": ["conv", "sliding_attention", "full_attention"], "num_attention_heads": 16,
    "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 7680, "sliding_window": 256,
    "conv_L_cache": 7, "max_position_embeddings": 128000})
# Qwen3-Next-80B-A3B's shapes (Gated DeltaNet: 16 key heads of 128 dims, 32 value heads of 128; gated attention of
# 16 heads of 256 over 2 KV heads), its layers cut to DeltaNet, attention, DeltaNet and its 512 experts to 16.
QWEN3_NEXT = ModelConfig.from_hf({
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 151936, "hidden_size": 2048,
    "num_hidden_layers": 3, "layer_types": ["linear_attention", "full_attention", "linear_attention"],
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "intermediate_size": 5120,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "num_experts": 16, "num_experts_per_tok": 10, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "max_position_embeddings": 262144})
# OLMo Hybrid 7B's shapes (transformers' defaults: DeltaNet of 30 key heads of 96 dims, 30 value heads of 192;
# attention of 30 heads of 128), cut to three DeltaNet layers and an attention layer.
OLMO_HYBRID = ModelConfig.from_hf({
    "architectures": ["OlmoHybridForCausalLM"], "model_type": "olmo_hybrid", "vocab_size": 100352,
    "hidden_size": 3840, "intermediate_size": 11008, "num_hidden_layers": 4, "num_attention_heads": 30,
    "max_position_embeddings": 65536, "rope_parameters": None})
# Falcon-H1: two layers, each a mixer of 24 heads of 128 channels (a state of 256, one group) beside attention of
# 12 heads of 128 over 2 KV heads, its mixer's output normed before its gate.
FALCON_H1 = ModelConfig.from_hf({
    "architectures": ["FalconH1ForCausalLM"], "model_type": "falcon_h1", "vocab_size": 65537, "hidden_size": 3072,
    "num_hidden_layers": 2, "num_attention_heads": 12, "num_key_value_heads": 2, "head_dim": 128,
    "intermediate_size": 12288, "mamba_d_ssm": 3072, "mamba_n_heads": 24, "mamba_d_state": 256, "mamba_n_groups": 1,
    "mamba_rms_norm": True, "max_position_embeddings": 262144, "key_multiplier": 0.5})
# Jamba-1.5-Mini's shapes (Mamba layers of 8192 channels, states of 16, a step of rank 256; attention of 32 heads of
# 128 over 8 KV heads), cut to a Mamba layer and an attention layer, and its 16 experts to 4.
JAMBA = ModelConfig.from_hf({
    "architectures": ["JambaForCausalLM"], "model_type": "jamba", "vocab_size": 65536, "hidden_size": 4096,
    "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
    "attn_layer_period": 2, "attn_layer_offset": 1, "num_experts": 4, "num_experts_per_tok": 2,
    "max_position_embeddings": 262144})
NUM_PAGES = 65536  # 16-token pages of the one attention layer: 1 GB of bfloat16 keys and values (Granite's)


def _pool(spec, cfg=GRANITE_H) -> tuple[KVCache, int]:
    shape = (len(cfg.attention_layers), NUM_PAGES, RC.page_size, cfg.num_kv_heads, cfg.head_dim)
    states = KVCache.state_shapes(cfg, RC.max_num_seqs + 1)
    kv = KVCache(k=spec(shape, DTYPE), v=spec(shape, DTYPE),
                 **{name: spec(s, jnp.float32) for name, s in states.items()})
    pages = NUM_PAGES * KVCache.bytes_per_page(cfg, RC.page_size, DTYPE)
    return kv, pages + 4 * sum(math.prod(s) for s in states.values())


@pytest.mark.gpu_compile
@pytest.mark.parametrize("name", ["granite-4.0-h", "nemotron-3-nano", "lfm3", "qwen3-next", "olmo-hybrid", "falcon-h1",
                                  "jamba"])
def test_hybrid_mixed_step_compiles_for_sm90(spec, name):
    cfg = {"granite-4.0-h": GRANITE_H, "nemotron-3-nano": NEMOTRON_3, "lfm3": LFM3, "qwen3-next": QWEN3_NEXT,
           "olmo-hybrid": OLMO_HYBRID, "falcon-h1": FALCON_H1, "jamba": JAMBA}[name]
    T = RC.token_buckets[-1]
    S = min(T, RC.max_num_seqs)
    params, _, _, pen, want_top = _common(spec, S, cfg=cfg)
    kv, pool_bytes = _pool(spec, cfg)
    sampling = _abstract(spec, SamplingTensors.from_params([], [], S, cfg.vocab_size, []))
    host = ModelInputs.build([([0], 0, [0])], RC.page_size, num_tokens=T, num_seqs=S, pages_per_seq=RC.pages_per_seq,
                             state_slots=[0])
    step = functools.partial(mixed_step, cfg=cfg, backend="pallas", top_k=RC.max_logprobs, hidden=True)
    seconds = _compile(step, params, kv, _abstract(spec, host), sampling, pen, PromptLogprobInputs(spec((T,), jnp.int32)),
                       want_top, pool_bytes=pool_bytes)
    print(f"{name} mixed_step T={T} S={S}: compiled for sm_90 in {seconds:.1f} s")


@pytest.mark.gpu_compile
def test_hybrid_decode_loop_compiles_for_sm90(spec):
    cfg = GRANITE_H
    S = RC.seq_buckets[-1]
    params, _, _, pen, want_top = _common(spec, S, cfg=cfg)
    kv, pool_bytes = _pool(spec)
    sampling = _abstract(spec, SamplingTensors.from_params([], [], S, cfg.vocab_size, []))
    st = dataclasses.replace(decode_state(spec, S), state_slots=spec((S,), jnp.int32))
    loop = functools.partial(decode_loop, cfg=cfg, backend="pallas", top_k=RC.max_logprobs,
                             n_max=RC.num_scheduler_steps)
    seconds = _compile(loop, params, kv, st, sampling, pen, want_top, pool_bytes=pool_bytes)
    print(f"granite-4.0-h decode_loop S={S}: compiled for sm_90 in {seconds:.1f} s")

