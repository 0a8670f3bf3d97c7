"""A MoE model's step with LoRA adapters on its experts (`models.lora.expert_lora_deltas`: grouped matmuls of every
slot's A of each expert, then the pairs' slot's B), compiled for sm_90 without a GPU.

A Qwen3-MoE-shaped model cut to two layers and 16 experts of 768 (the 30B-A3B's expert width, 8 of them per token),
4 adapter slots of rank 16, in the largest token bucket: the experts' own grouped matmuls and the adapters' lower to
ragged dots of the same groups.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import pytest

from jaxserve.config import ModelConfig
from jaxserve.engine.logprobs import PromptLogprobInputs
from jaxserve.engine.runner import mixed_step
from jaxserve.engine.sampler import SamplingTensors
from jaxserve.models.inputs import KVCache, ModelInputs
from jaxserve.models.lora import empty_lora
from tests.gpu_compile.test_compile_engine import DTYPE, RC, _abstract, _common, _compile

QWEN3_MOE = ModelConfig.from_hf({
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 6144, "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 16, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
    "norm_topk_prob": True, "max_position_embeddings": 40960, "rope_theta": 1000000.0, "tie_word_embeddings": False})
NUM_PAGES = 32768  # 16-token pages: 1 GB of bfloat16 keys and values over the 2 layers


@pytest.mark.gpu_compile
def test_moe_step_with_expert_adapters_compiles_for_sm90(spec):
    cfg = QWEN3_MOE
    T = RC.token_buckets[-1]
    S = min(T, RC.max_num_seqs)
    params, _, _, pen, want_top = _common(spec, S, cfg=cfg)
    shape = (cfg.num_layers, NUM_PAGES, RC.page_size, cfg.num_kv_heads, cfg.head_dim)
    kv = KVCache(k=spec(shape, DTYPE), v=spec(shape, DTYPE))
    sampling = _abstract(spec, SamplingTensors.from_params([], [], S, cfg.vocab_size, []))
    lora = jax.eval_shape(lambda: empty_lora(cfg, 4, 16, DTYPE))
    assert lora.ae_gate_up.shape == (2, 16, 2048, 4, 32)
    params.layers = dataclasses.replace(params.layers, lora=jax.tree.map(lambda a: spec(a.shape, a.dtype), lora))
    host = ModelInputs.build([([0], 0, [0])], RC.page_size, num_tokens=T, num_seqs=S, pages_per_seq=RC.pages_per_seq,
                             lora_slots=[1])
    step = functools.partial(mixed_step, cfg=cfg, backend="pallas", top_k=RC.max_logprobs, hidden=True)
    # The experts (and their adapters) on the grouped matmul's Triton kernel, not its interpreter's XLA loop.
    grouped = re.compile(r'custom_call_target="__gpu\$xla\.gpu\.triton".*op_name="[^"]*grouped_matmul')
    seconds = _compile(step, params, kv, _abstract(spec, host), sampling, pen, PromptLogprobInputs(spec((T,), jnp.int32)),
                       want_top, pool_bytes=NUM_PAGES * KVCache.bytes_per_page(cfg, RC.page_size, DTYPE),
                       on_text=lambda text: _count(grouped, text))
    print(f"qwen3_moe mixed_step with expert LoRA T={T} S={S}: compiled for sm_90 in {seconds:.1f} s")


def _count(pattern: re.Pattern, text: str) -> None:
    found = sum(1 for line in text.splitlines() if pattern.search(line))
    assert found >= 4, f"{found} grouped-matmul Triton kernels in the step: the experts' matmuls are not on the kernel"
