"""The engine's jitted steps for a DeepSeek-V2-Lite-shaped model (multi-head latent attention), a DeepSeek-V3.2-shaped
one (its sparse attention) and a GLM-5.2-like one (layers sharing a choice of keys), compiled for sm_90 without a GPU.

DeepSeek-V2-Lite's attention (16 heads; a 512-dim latent and a 64-dim rotary key per token, 576 wide in the pages;
128 unrotated query dims absorbed into the latent, 128-dim values) on a dense layer and a MoE layer of 8 experts:
the step runs the latent attention kernel (pallas_kernels/latent_attention.py, the Triton lowering), with the page
pool, which holds no values, updated in place.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import pytest

from jaxserve.config import ModelConfig
from jaxserve.engine.logprobs import PromptLogprobInputs
from jaxserve.engine.penalties import PenaltyInputs
from jaxserve.engine.runner import decode_loop, mixed_step
from jaxserve.engine.sampler import SamplingTensors
from jaxserve.models.inputs import KVCache, ModelInputs
from jaxserve.models.params import abstract_params
from tests.gpu_compile.test_compile_engine import DTYPE, RC, _abstract, _compile, decode_state, model_inputs

V2_LITE = ModelConfig.from_hf({
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
    "hidden_size": 2048, "intermediate_size": 10944, "num_hidden_layers": 2, "num_attention_heads": 16,
    "num_key_value_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 8, "num_experts_per_tok": 6,
    "moe_intermediate_size": 1408, "n_shared_experts": 2, "first_k_dense_replace": 1, "max_position_embeddings": 8192,
    "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32,
                     "beta_slow": 1, "original_max_position_embeddings": 4096}})
NUM_PAGES = 32768  # 16-token pages: 1.2 GB of bfloat16 latents over the 2 layers
# DeepSeek-V3.2's attention (128 heads; the indexer's 64 heads of 128 dims, its key in the pages: 704 wide; the top
# 2048 keys a token) on a dense layer and a MoE layer of 8 of its 256 experts: the indexer's scores on the indexer
# kernel, their top-k in XLA, the attention over the chosen entries on the sparse latent kernel.
V32_HF = {
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 2, "num_attention_heads": 128,
    "num_key_value_heads": 128, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 8, "num_experts_per_tok": 8,
    "moe_intermediate_size": 2048, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048, "max_position_embeddings": 163840,
    "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32,
                     "beta_slow": 1, "original_max_position_embeddings": 4096}}
V32 = ModelConfig.from_hf(V32_HF)
# GLM-5.2's IndexShare on V3.2's shapes (GLM-5's 32 indexer heads): its second and third layers attend the first's
# choice (carried through the layer loop, past the dense layer into the MoE stack), the fourth chooses its own.
GLM52 = ModelConfig.from_hf(V32_HF | {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
                                      "num_hidden_layers": 4, "index_n_heads": 32,
                                      "indexer_types": ["full", "shared", "shared", "full"]})


@pytest.mark.gpu_compile
@pytest.mark.parametrize("cfg", [V2_LITE, V32, GLM52], ids=["deepseek_v2", "deepseek_v32", "glm_5_2"])
def test_mla_steps_compile_for_sm90(spec, cfg):
    assert cfg.kv_cache_dims == ((704 if cfg.index_topk else 576), 0) and cfg.num_kv_heads == 1
    T, S = RC.token_buckets[-1], RC.max_num_seqs
    params, kv, sampling, pen, want_top, pool_bytes = model_inputs(spec, cfg, NUM_PAGES, S)
    host = ModelInputs.build([([0], 0, [0])], RC.page_size, num_tokens=T, num_seqs=S, pages_per_seq=RC.pages_per_seq)
    step = functools.partial(mixed_step, cfg=cfg, backend="pallas", top_k=RC.max_logprobs, hidden=True)
    seconds = _compile(step, params, kv, _abstract(spec, host), sampling, pen, PromptLogprobInputs(spec((T,), jnp.int32)),
                       want_top, pool_bytes=pool_bytes)
    print(f"{cfg.family} mixed_step T={T} S={S}: compiled for sm_90 in {seconds:.1f} s")
    if cfg.index_topk:  # (the decode loop's steps run the same sparse attention)
        return
    loop = functools.partial(decode_loop, cfg=cfg, backend="pallas", top_k=RC.max_logprobs,
                             n_max=RC.num_scheduler_steps)
    seconds = _compile(loop, params, kv, decode_state(spec, S), sampling, pen, want_top,
                       pool_bytes=pool_bytes)
    print(f"{cfg.family} decode_loop S={S}: compiled for sm_90 in {seconds:.1f} s")


@pytest.mark.gpu_compile
def test_mla_step_with_adapters_compiles_for_sm90(spec):
    """The mixed step with LoRA slots on the latent attention (q_proj, kv_a_proj_with_mqa, kv_b_proj through the
    absorbed up-projections, o_proj), the dense layer's MLP and the MoE layer's experts, router and shared experts."""
    import dataclasses

    import jax

    from jaxserve.models.lora import empty_lora

    cfg = V2_LITE
    T, S = RC.token_buckets[-1], RC.max_num_seqs
    params = _abstract(spec, abstract_params(cfg, DTYPE))
    lora = jax.tree.map(lambda a: spec(a.shape, a.dtype), jax.eval_shape(lambda: empty_lora(cfg, 4, 16, DTYPE)))
    assert lora.b_kvb.shape == (2, 4, 16, 16 * (128 + 128)) and lora.b_k is None
    k = cfg.first_dense_layers
    rows = lambda n: jax.tree.map(lambda a: spec((n, *a.shape[1:]), a.dtype), lora)  # noqa: E731 (layers' slots)
    params = dataclasses.replace(params, layers=dataclasses.replace(params.layers, lora=rows(cfg.num_layers - k)),
                                 dense_layers=dataclasses.replace(params.dense_layers, lora=rows(k)))
    shape = (cfg.num_layers, NUM_PAGES, RC.page_size, cfg.num_kv_heads)
    kv = KVCache(k=spec((*shape, 576), DTYPE), v=spec((*shape, 0), DTYPE))
    sampling = _abstract(spec, SamplingTensors.from_params([], [], S, cfg.vocab_size, []))
    pen = PenaltyInputs(spec((S, RC.max_model_len), jnp.int32), spec((S,), jnp.int32))
    host = ModelInputs.build([([0], 0, [0])], RC.page_size, num_tokens=T, num_seqs=S, pages_per_seq=RC.pages_per_seq,
                             lora_slots=[1])
    step = functools.partial(mixed_step, cfg=cfg, backend="pallas", top_k=RC.max_logprobs, hidden=True)
    seconds = _compile(step, params, kv, _abstract(spec, host), sampling, pen, PromptLogprobInputs(spec((T,), jnp.int32)),
                       spec((), jnp.bool_), pool_bytes=NUM_PAGES * KVCache.bytes_per_page(cfg, RC.page_size, DTYPE))
    print(f"deepseek_v2 mixed_step with LoRA T={T} S={S}: compiled for sm_90 in {seconds:.1f} s")
