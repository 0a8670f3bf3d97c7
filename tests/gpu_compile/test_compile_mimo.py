"""The engine's jitted steps for a MiMo-V2-Flash-shaped model, compiled for sm_90 without a GPU.

MiMo-V2-Flash's attention (64 query heads of 192 over 8 KV heads on the windowed layers, 4 held twice on the full
ones; values of 128 padded to 192; sinks on the windowed layers, -inf on the full ones; a 128-key window; a third of
each head rotated, two rotary bases) on seven layers of a narrower model with 8 of its experts, as the engine runs it on
a Hopper GPU (`pallas_mosaic`): a dense full first layer, then the MoE stack in groups of six. The 192-wide heads reach
the Mosaic GPU decode kernel and the ragged one inside the engine steps.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import pytest

from jaxserve.config import ModelConfig
from jaxserve.engine.logprobs import PromptLogprobInputs
from jaxserve.engine.runner import decode_loop, mixed_step
from jaxserve.models.inputs import ModelInputs
from tests.gpu_compile.test_compile_engine import RC, _abstract, _compile, decode_state, model_inputs

MIMO = ModelConfig.from_hf({
    "architectures": ["MiMoV2FlashForCausalLM"], "model_type": "mimo_v2_flash", "vocab_size": 152576,
    "hidden_size": 1024, "intermediate_size": 2048, "moe_intermediate_size": 512, "num_hidden_layers": 7,
    "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 192, "v_head_dim": 128, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "sliding_window": 129, "attention_value_scale": 0.707})
NUM_PAGES = 16384  # 16-token pages: 5.6 GB of bfloat16 K and V over the 7 layers


@pytest.mark.gpu_compile
def test_mimo_steps_compile_for_sm90(spec):
    assert (MIMO.num_kv_heads, MIMO.head_dim, MIMO.attention_value_dim, MIMO.rotary_dims) == (8, 192, 128, 64)
    T, S = RC.token_buckets[-1], RC.max_num_seqs
    params, kv, sampling, pen, want_top, pool_bytes = model_inputs(spec, MIMO, NUM_PAGES, S)
    host = ModelInputs.build([([0], 0, [0])], RC.page_size, num_tokens=T, num_seqs=S, pages_per_seq=RC.pages_per_seq)
    step = functools.partial(mixed_step, cfg=MIMO, backend="pallas_mosaic", top_k=RC.max_logprobs, hidden=True)
    seconds = _compile(step, params, kv, _abstract(spec, host), sampling, pen, PromptLogprobInputs(spec((T,), jnp.int32)),
                       want_top, mosaic=True, triton=False, pool_bytes=pool_bytes)
    print(f"mimo_v2_flash mixed_step T={T} S={S}: compiled for sm_90 in {seconds:.1f} s")
    loop = functools.partial(decode_loop, cfg=MIMO, backend="pallas_mosaic", top_k=RC.max_logprobs,
                             n_max=RC.num_scheduler_steps)
    seconds = _compile(loop, params, kv, decode_state(spec, S), sampling, pen, want_top, mosaic=True, triton=False,
                       pool_bytes=pool_bytes)
    print(f"mimo_v2_flash decode_loop S={S}: compiled for sm_90 in {seconds:.1f} s")
