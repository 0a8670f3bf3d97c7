"""Multi-device cases run in a child process with 8 simulated CPU devices (see `run_cases`).

The device count is fixed when JAX starts, and the rest of the suite runs on one device, so
these cases run as `python -m tests.test_sharding_worker CASE...` and print their findings as
JSON. Nothing here runs at import; pytest collects no tests from this file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

RESULT_PREFIX = "RESULT:"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Generous: warm, the 8-device worker takes 100-125 s; with the compilation cache cold, over 600 s on 2 cores.
WORKER_TIMEOUT_S = 1800.0


def run_cases(*cases: str, devices: int = 8, timeout: float = WORKER_TIMEOUT_S) -> dict:
    """Run the named cases in a fresh process with `devices` CPU devices; returns {case: findings}."""
    return run_module("tests.test_sharding_worker", *cases, devices=devices, timeout=timeout)


def run_module(module: str, *args: str, devices: int, timeout: float = WORKER_TIMEOUT_S) -> dict:
    """`python -m module args...` in a fresh process with `devices` CPU devices; returns the JSON it
    printed last after RESULT_PREFIX."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"{module} {args} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len(RESULT_PREFIX):])


# -- helpers used inside the child --------------------------------------------------------------------

def dense_config():
    from jaxserve.config import ModelConfig

    # 8 query heads and 2 KV heads: TP 1 and 2 split KV heads, TP 4 and 8 replicate them.
    return ModelConfig(family="qwen2", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=8, num_kv_heads=2, head_dim=16, attention_bias=True, max_position_embeddings=512)


def gemma_config():
    from jaxserve.config import ModelConfig

    # A windowed and a global layer, soft-caps, post-attention and post-MLP norms over the same head layout.
    return ModelConfig(family="gemma2", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=8, num_kv_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=8,
                       layer_types=("sliding_attention", "full_attention"), hidden_act="gelu_pytorch_tanh",
                       attn_logit_softcap=5.0, final_logit_softcap=10.0, query_pre_attn_scalar=24.0,
                       tie_word_embeddings=True)


def moe_config(family: str = "qwen2_moe"):
    from jaxserve.config import ModelConfig

    # GLM-4.5: a dense first layer, then MoE layers with sigmoid routing over 2 groups of 4 experts.
    glm = dict(router_scoring="sigmoid", expert_groups=2, expert_topk_groups=1, routed_scaling_factor=2.5,
               first_dense_layers=1, num_layers=3, rotary_dim=8) if family == "glm4_moe" else {}
    # gpt-oss: attention sinks, a windowed and a global layer, biased router and experts, a clamped SwiGLU.
    if family == "gpt_oss":
        glm = dict(layer_types=("sliding_attention", "full_attention"), sliding_window=8, swiglu_limit=0.3)
    # DeepSeek-V3: latent attention (one latent, copied to each TP device), GLM-4.5's experts.
    # (V3.2: its indexer picks 4 keys a token; GLM-5.2: layer 1 reuses layer 0's choice)
    if family in ("deepseek_v3", "deepseek_v32", "glm_moe_dsa"):
        glm = {**moe_config("glm4_moe").__dict__, **dict(
            num_kv_heads=1, head_dim=24, rotary_dim=8, attention_bias=False, kv_lora_rank=32, q_lora_rank=24,
            v_head_dim=12, family=family), **(dict(index_heads=4, index_head_dim=16, index_topk=4)
                                              if family != "deepseek_v3" else {}),
               **(dict(index_shared_layers=(1,)) if family == "glm_moe_dsa" else {})}
    # Command A MoE's layers: attention and experts side by side on one LayerNormed input, a dense first layer of its
    # own width, windowed and NoPE layers, a shared expert averaged with the routed ones.
    if family == "cohere2_moe":
        glm = dict(first_dense_layers=1, num_layers=3, intermediate_size=96, sliding_window=8, rotary_dim=None,
                   layer_types=("full_attention", "sliding_attention", "full_attention"), no_rope_layers=(1, 1, 0),
                   shared_expert_intermediate_size=32, routed_scaling_factor=0.5, shared_expert_scale=0.5,
                   norm_topk_prob=True, tie_word_embeddings=True)
    return ModelConfig(**{**dict(
        family=family, vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, attention_bias=family in ("qwen2_moe", "glm4_moe", "gpt_oss"), qk_norm=family == "qwen3_moe",
        max_position_embeddings=512, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=family != "qwen2_moe",
        shared_expert_intermediate_size={"qwen2_moe": 48, "glm4_moe": 32}.get(family, 0)), **glm})


def maverick_config():
    """Llama 4 Maverick's layout, tiny: experts in every second layer, a dense MLP in the others; Scout's attention."""
    import transformers

    from jaxserve.config import ModelConfig
    from tests.test_llama4 import TINY
    from tests.test_model_families import TINY as BASE

    return ModelConfig.from_hf(transformers.Llama4TextConfig(**{**BASE, **TINY, "interleave_moe_layer_step": 2}).to_dict())


def _steps(page_size: int = 8):
    """Two steps over two sequences: a prefill of 13 and 7 tokens, then one decode token each."""
    import numpy as np

    from jaxserve.models.inputs import ModelInputs

    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 64, 13).tolist(), rng.integers(0, 64, 7).tolist()
    pages_a, pages_b = [5, 2, 9], [7, 3]
    prefill = ModelInputs.build([(a, 0, pages_a), (b, 0, pages_b)], page_size, num_tokens=32, num_seqs=4,
                                pages_per_seq=4, all_logits=True)
    # The same bucket as the prefill, so both steps share one executable.
    decode = ModelInputs.build([([11], 13, pages_a), ([12], 7, pages_b)], page_size, num_tokens=32, num_seqs=4,
                               pages_per_seq=4, all_logits=True)
    return prefill, decode


def _run_steps(cfg, params, kv, plan=None, backend: str = "xla"):
    import functools

    import jax
    import numpy as np

    from jaxserve.models.llama import forward

    fn = functools.partial(forward, cfg=cfg, backend=backend, **({"layout": plan.layout()} if plan else {}))
    kw = {}
    if plan is not None:
        sh = plan.step_shardings()
        kw = dict(in_shardings=(sh.params, sh.kv, sh.replicated), out_shardings=(sh.replicated, sh.kv))
    step = jax.jit(fn, donate_argnums=(1,), **kw)
    out = []
    for inputs in _steps():
        inputs = jax.tree.map(np.asarray, inputs)
        logits, kv = step(params, kv, inputs)
        out.append(np.asarray(logits)[: int(inputs.query_start_loc[-1])])  # the real tokens' rows
    return out


def _rel(a, b) -> float:
    import numpy as np

    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _sweep(cfg, layouts, backend: str = "xla"):
    """Logits of the two steps unsharded (xla backend) and under each (tp, ep) layout on `backend`; relative errors
    and shard shapes."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from jaxserve.models.inputs import KVCache
    from jaxserve.models.params import init_params
    from sharding import ParallelConfig, make_mesh, make_plan

    params = init_params(cfg, jax.random.PRNGKey(0), scale=0.1)
    if cfg.qk_norm_heads:  # a weight per head and dim, each its own (initialized to one)
        q, k = (1 + 0.2 * jax.random.normal(jax.random.PRNGKey(i), w.shape) for i, w in
                enumerate((params.layers.q_norm, params.layers.k_norm)))
        params = dataclasses.replace(params, layers=dataclasses.replace(params.layers, q_norm=q, k_norm=k))
    zeros = ("router_bias", "b_router", "be_gate", "be_up", "be_down", "sinks", "bq", "bk", "bv", "bo")
    params = dataclasses.replace(params, layers=dataclasses.replace(params.layers, **{  # (initialized to zero)
        name: 0.2 * jax.random.normal(jax.random.PRNGKey(i), getattr(params.layers, name).shape)
        for i, name in enumerate(zeros) if getattr(params.layers, name) is not None}))
    ref = _run_steps(cfg, params, KVCache.allocate(cfg, 16, 8, jnp.float32))
    found = {}
    for tp, ep in layouts:
        plan = make_plan(cfg, make_mesh(ParallelConfig(tp, ep)))
        sp = plan.shard_params(params)
        kv = plan.allocate_kv(16, 8, jnp.float32)
        kv_shard_heads = kv.k.addressable_shards[0].data.shape[3]  # read before the steps donate it
        got = _run_steps(plan.model_cfg, sp, kv, plan, backend)
        entry = {
            "rel_prefill": _rel(got[0], ref[0]), "rel_decode": _rel(got[1], ref[1]),
            "argmax_equal": bool((got[0].argmax(-1) == ref[0].argmax(-1)).all()),
            "kv_repeat": plan.kv_repeat,
            "kv_shard_heads": kv_shard_heads,
            "wq_shard_heads": sp.layers.wq.addressable_shards[0].data.shape[2],
            "embed_shard_vocab": sp.embed.addressable_shards[0].data.shape[0],
            "num_devices": len(sp.layers.wq.sharding.device_set),
        }
        if sp.dense_layers is not None:  # a dense first layer's MLP, split like a dense model's
            entry["dense_mlp_per_device"] = sp.dense_layers.w_gate.addressable_shards[0].data.shape[2]
        if cfg.num_experts:
            entry["experts_per_device"] = sp.layers.we_gate.addressable_shards[0].data.shape[1]
            entry["expert_width_per_device"] = sp.layers.we_gate.addressable_shards[0].data.shape[3]
        found[f"tp{tp}_ep{ep}"] = entry
    return found


def olmo2_config():
    from jaxserve.config import ModelConfig

    # Norms after attention and the MLP only; q and k normed over all their heads, which TP splits (TP=4 repeats
    # the two KV heads).
    return ModelConfig(family="olmo2", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=8, num_kv_heads=2, head_dim=16, max_position_embeddings=512, qk_norm=True)


def case_dense() -> dict:
    # (Each layout compiles the model once more in this child: one device, the unsharded reference, is left out.)
    out = _sweep(dense_config(), [(2, 1), (4, 1), (8, 1)])
    out.update({f"gemma2_{k}": v for k, v in _sweep(gemma_config(), [(2, 1)]).items()})
    out.update({f"olmo2_{k}": v for k, v in _sweep(olmo2_config(), [(4, 1)]).items()})
    # The kernels (interpreted) on each device's heads: KV heads split (TP=2: windows, soft-caps) and repeated (TP=4).
    out.update({f"pallas_gemma2_{k}": v for k, v in _sweep(gemma_config(), [(2, 1)], "pallas_interpret").items()})
    out.update({f"pallas_{k}": v for k, v in _sweep(dense_config(), [(4, 1)], "pallas_interpret").items()})
    # Falcon-RW's ALiBi slopes, split with their heads (on the XLA path, and into each device's kernel).
    rw = falcon_rw_config()
    out.update({f"falcon_rw_{k}": v for k, v in _sweep(rw, [(2, 1)]).items()})
    out.update({f"pallas_falcon_rw_{k}": v for k, v in _sweep(rw, [(2, 1)], "pallas_interpret").items()})
    return out


def falcon_rw_config():
    from jaxserve.config import ModelConfig

    return ModelConfig.from_hf(dict(architectures=["FalconForCausalLM"], model_type="falcon", vocab_size=64,
                                    hidden_size=128, num_attention_heads=8, num_hidden_layers=2, multi_query=False,
                                    parallel_attn=False, alibi=True, bias=True))


def case_moe() -> dict:
    out = _sweep(moe_config("qwen2_moe"), [(1, 4), (2, 2)])
    out.update({f"qwen3_{k}": v for k, v in _sweep(moe_config("qwen3_moe"), [(1, 4)]).items()})
    out.update({f"glm4_{k}": v for k, v in _sweep(moe_config("glm4_moe"), [(2, 2)]).items()})
    out.update({f"gpt_oss_{k}": v for k, v in _sweep(moe_config("gpt_oss"), [(2, 2)]).items()})
    out.update({f"mla_{k}": v for k, v in _sweep(moe_config("deepseek_v3"), [(2, 2)]).items()})
    out.update({f"dsa_{k}": v for k, v in _sweep(moe_config("deepseek_v32"), [(2, 2)]).items()})
    out.update({f"maverick_{k}": v for k, v in _sweep(maverick_config(), [(2, 2)]).items()})
    out.update({f"cohere2_moe_{k}": v for k, v in _sweep(moe_config("cohere2_moe"), [(2, 2)]).items()})
    # The kernels (interpreted) on each device's heads: gpt-oss's sinks split with them, DeepSeek's latents.
    out.update({f"pallas_gpt_oss_{k}": v for k, v in _sweep(moe_config("gpt_oss"), [(2, 2)], "pallas_interpret").items()})
    out.update({f"pallas_mla_{k}": v for k, v in _sweep(moe_config("deepseek_v3"), [(2, 2)], "pallas_interpret").items()})
    out.update({f"pallas_dsa_{k}": v for k, v in _sweep(moe_config("glm_moe_dsa"), [(2, 2)], "pallas_interpret").items()})
    return out


def _tiny_loaded(cfg):
    import jax
    import jax.numpy as jnp

    from jaxserve.engine.model_loading import LoadedModel
    from jaxserve.models.params import init_params
    from tests.fake_model import fake_tokenizer

    return LoadedModel("tiny", "tiny", cfg, init_params(cfg, jax.random.PRNGKey(0), scale=0.1), fake_tokenizer(),
                       jnp.float32, 0.0)


ENGINE_ARGS = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, page_size=8,
                   kv_cache_memory_bytes=2 * 2 * 64 * 8 * 2 * 16 * 4, num_scheduler_steps=4, compile_cache_dir=None)
PROMPTS = [[3, 4, 5, 6, 7], [9, 8, 7, 30, 31, 32, 33, 34, 35, 36, 37], [50, 2, 40]]


def _generate(engine, prompts, lora: str | None = None, max_tokens: int = 12) -> list[list[int]]:
    from jaxserve.sampling_params import SamplingParams

    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                           lora_request=lora)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
    engine.check_integrity()
    return [final[str(i)] for i in range(len(prompts))]


def _embed(engine, prompts) -> list[list[float]]:
    from jaxserve.pooling_params import PoolingParams

    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, PoolingParams())
    final = {}
    while engine.has_unfinished_requests():
        final.update((out.request_id, out.outputs.embedding) for out in engine.step())
    engine.check_integrity()
    return [final[str(i)] for i in range(len(prompts))]


def case_engine() -> dict:
    """Greedy generation through the engine, one device vs TP=2, with compile counts after warmup."""
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine_args import EngineArgs

    loaded = _tiny_loaded(dense_config())
    single = LLMEngine(EngineArgs(**ENGINE_ARGS), loaded=loaded, progress=False)
    ref = _generate(single, PROMPTS)
    t0 = time.perf_counter()
    sharded = LLMEngine(EngineArgs(**ENGINE_ARGS, tensor_parallel_size=2, strict_compile=True), loaded=loaded,
                        progress=False)
    warm = time.perf_counter() - t0
    got = _generate(sharded, PROMPTS)
    # A float8 cache, split by KV head over the two devices as its raw bits, on scales calculated at start-up.
    fp8 = dict(ENGINE_ARGS, kv_cache_dtype="fp8", calculate_kv_scales=True)
    fp8_single = LLMEngine(EngineArgs(**fp8), loaded=loaded, progress=False)
    fp8_ref = _generate(fp8_single, PROMPTS)
    fp8_tp2 = LLMEngine(EngineArgs(**fp8, tensor_parallel_size=2, strict_compile=True), loaded=loaded, progress=False)
    scales = [[float(lp.k_scale), float(lp.v_scale)] for e in (fp8_single, fp8_tp2) for lp in e.model.params.layers]
    pooled = {}  # an embedding model's step (chunked prompts, last-token pooling), one device vs TP=2
    for name, tp in (("single", 1), ("tp2", 2)):
        engine = LLMEngine(EngineArgs(**ENGINE_ARGS, runner="pooling", tensor_parallel_size=tp, strict_compile=True),
                           loaded=loaded, progress=False)
        pooled[name] = _embed(engine, PROMPTS)
        pooled[name + "_compiles_after_warmup"] = engine.stats().compilations_after_warmup
    return {
        "pooled": pooled,
        "ref": ref, "tp2": got, "compiles_after_warmup": sharded.stats().compilations_after_warmup,
        "single_compiles_after_warmup": single.stats().compilations_after_warmup,
        "tp2_devices": len(sharded.runner.kv.k.sharding.device_set), "tp2_warmup_s": warm,
        "fp8_ref": fp8_ref, "fp8_tp2": _generate(fp8_tp2, PROMPTS),
        "fp8_pool": [str(fp8_tp2.runner.kv.k.dtype), str(fp8_tp2.runner.kv.dtype),
                     len(fp8_tp2.runner.kv.k.sharding.device_set)],
        "fp8_scales": scales, "fp8_compiles_after_warmup": fp8_tp2.stats().compilations_after_warmup,
    }


def case_draft() -> dict:
    """Speculative decoding with a draft model at TP=2 (the model drafting for itself, read back from a checkpoint
    written of it): the draft and its pool whole on both devices, the greedy tokens without drafts, every draft
    accepted, nothing compiled after warmup."""
    import tempfile

    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine_args import EngineArgs
    from jaxserve.loader.export import export_hf

    loaded = _tiny_loaded(dense_config())
    args = dict(ENGINE_ARGS, max_num_seqs=16, kv_cache_memory_bytes=4 * ENGINE_ARGS["kv_cache_memory_bytes"])
    with tempfile.TemporaryDirectory() as path:
        export_hf(path, loaded.config, loaded.params, loaded.tokenizer)
        engine = LLMEngine(EngineArgs(**args, tensor_parallel_size=2, strict_compile=True,
                                      speculative_config={"model": path, "num_speculative_tokens": 3}),
                           loaded=loaded, progress=False)
    drafter, engine.drafter = engine.drafter, None
    ref = _generate(engine, PROMPTS, max_tokens=24)  # without drafts (TP=2 equals one device: case_engine)
    engine.drafter, drafter.costs = drafter, None  # every draft the step has room for
    got = _generate(engine, PROMPTS, max_tokens=24)
    stats = engine.stats()
    return {"ref": ref, "tp2": got, "drafted": stats.spec_num_draft_tokens, "accepted": stats.spec_num_accepted_tokens,
            "compiles_after_warmup": stats.compilations_after_warmup,
            "devices": [len(engine.draft.kv.k.sharding.device_set), len(engine.draft.params.embed.sharding.device_set),
                        len(engine.runner.kv.k.sharding.device_set)],
            "pages": [engine.scheduler.pool.num_pages, engine.draft.kv.k.shape[1]]}


def _drafting_tp2(path: str, speculative_config: dict, weight: str) -> dict:
    """A TP=2 engine of the model at `path` (`test_mtp`'s and `test_eagle`'s settings), warmed up, drafting as
    `speculative_config` says: its greedy tokens without drafts and with them (every draft verified), the drafts
    taken, compiles after warmup, and the devices holding the drafter's pool, its `weight` and the model's pool."""
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine_args import EngineArgs
    from tests.test_mtp import ARGS, PROMPTS

    engine = LLMEngine(EngineArgs(model=path, **{**ARGS, "warmup": True}, tensor_parallel_size=2, strict_compile=True,
                                  speculative_config=speculative_config), progress=False)
    drafter, engine.drafter = engine.drafter, None
    ref = _generate(engine, PROMPTS, max_tokens=24)
    engine.drafter, drafter.costs = drafter, None  # every draft the step has room for
    got = _generate(engine, PROMPTS, max_tokens=24)
    stats = engine.stats()
    return {"ref": ref, "tp2": got, "drafted": stats.spec_num_draft_tokens, "accepted": stats.spec_num_accepted_tokens,
            "compiles_after_warmup": stats.compilations_after_warmup, "hidden_layers": engine.runner.cfg.hidden_layers,
            "devices": [len(engine.draft.kv.k.sharding.device_set),
                        len(getattr(engine.draft.params, weight).sharding.device_set),
                        len(engine.runner.kv.k.sharding.device_set)]}


def case_mtp() -> dict:
    """Speculative decoding with GLM-4.5's multi-token prediction layer at TP=2 (`test_mtp`'s tiny checkpoint): the
    layer and its pool whole on both devices, the model's hidden states read from its sharded steps, the greedy
    tokens without drafts, drafts taken, nothing compiled after warmup."""
    import tempfile

    from tests.test_mtp import save_with_mtp

    with tempfile.TemporaryDirectory() as path:
        save_with_mtp("glm4_moe", path)
        return _drafting_tp2(path, {"method": "mtp", "num_speculative_tokens": 2}, "eh_proj")


def case_eagle() -> dict:
    """Speculative decoding with an EAGLE-3 head at TP=2 (`test_eagle`'s tiny target and head): the head and its pool
    whole on both devices, the hidden states entering three layers read from the sharded steps, the greedy tokens
    without drafts, drafts taken, nothing compiled after warmup."""
    import tempfile

    from tests.test_eagle import _spec, _target, save_head

    with tempfile.TemporaryDirectory() as path:
        save_head("eagle3", f"{path}/head", _target(path))
        return _drafting_tp2(path, _spec("eagle3", f"{path}/head", 2), "fc")


def case_dp() -> dict:
    """Two TP=2 replicas behind the data-parallel facade: placement, tokens, devices, compiles."""

    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine_args import EngineArgs
    from sharding import DataParallelEngine

    loaded = _tiny_loaded(dense_config())
    prompts = PROMPTS + [[1, 2, 3, 4]]
    ref = _generate(LLMEngine(EngineArgs(**ENGINE_ARGS, warmup=False), loaded=loaded, progress=False), prompts)
    args = EngineArgs(**ENGINE_ARGS, tensor_parallel_size=2, data_parallel_size=2, strict_compile=True,
                      speculative_config={"method": "suffix"})
    dp = DataParallelEngine.from_engine_args(args, loaded=loaded, progress=False)
    tokens, placed = _dp_generate(dp, prompts)
    devices = [sorted(d.id for d in r.engine.runner.kv.k.sharding.device_set) for r in dp.replicas]
    found = {
        "ref": ref, "dp": tokens, "placed": placed,
        "devices": devices, "in_flight_after": dp.in_flight(),
        "compiles_after_warmup": dp.stats().compilations_after_warmup,
        "per_replica_prompt_tokens": [r.stats().prompt_tokens for r in dp.replicas],
        # suffix decoding: one cache of both replicas' responses
        "suffix_shared": dp.replicas[1].engine.drafter.suffix is dp.replicas[0].engine.drafter.suffix,
        "suffix_cached": len(dp.replicas[0].engine.drafter.suffix._cached),
    }
    dp.shutdown()
    return found


def case_engine_moe() -> dict:
    """Greedy generation of a Qwen2-MoE model through the engine, one device vs EP=2 x TP=2."""
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine_args import EngineArgs

    loaded = _tiny_loaded(moe_config("qwen2_moe"))
    ref = _generate(LLMEngine(EngineArgs(**ENGINE_ARGS, warmup=False), loaded=loaded, progress=False), PROMPTS)
    sharded = LLMEngine(EngineArgs(**ENGINE_ARGS, tensor_parallel_size=2, expert_parallel_size=2,
                                   strict_compile=True), loaded=loaded, progress=False)
    got = _generate(sharded, PROMPTS)
    # vLLM's --enable-expert-parallel: TP=2 with the experts whole, half of them on each device.
    whole = LLMEngine(EngineArgs(**ENGINE_ARGS, tensor_parallel_size=2, enable_expert_parallel=True,
                                 strict_compile=True), loaded=loaded, progress=False)
    layers = whole.runner.params.layers
    we_gate = (layers[0] if isinstance(layers, tuple) else layers).we_gate
    shard = we_gate.addressable_shards[0].data.shape  # [(L,) X, E, Fe] of one device
    whole_found = {"tokens": _generate(whole, PROMPTS), "experts_per_device": shard[-3], "width_per_device": shard[-1],
                   "compiles_after_warmup": whole.stats().compilations_after_warmup}
    # A LoRA adapter on the attention, the experts, the router and the shared expert: EP=2 x TP=2 against one device.
    lora = dict(enable_lora=True, max_loras=2, max_lora_rank=4, lora_modules=(("attn", _attention_adapter(loaded.config)),))
    lora_ref = _generate(LLMEngine(EngineArgs(**ENGINE_ARGS, **lora, warmup=False), loaded=loaded, progress=False),
                         PROMPTS, "attn")
    lora_ep = LLMEngine(EngineArgs(**ENGINE_ARGS, **lora, tensor_parallel_size=2, expert_parallel_size=2,
                                   strict_compile=True), loaded=loaded, progress=False)
    # DeepSeek-V3's latent attention (kv_b_proj's delta applied through the absorbed up-projections) under TP=2 x EP=2.
    mla = _tiny_loaded(moe_config("deepseek_v3"))
    lora["lora_modules"] = (("attn", _attention_adapter(mla.config)),)
    mla_ref = _generate(LLMEngine(EngineArgs(**ENGINE_ARGS, **lora, warmup=False), loaded=mla, progress=False),
                        PROMPTS, "attn")
    mla_ep = LLMEngine(EngineArgs(**ENGINE_ARGS, **lora, tensor_parallel_size=2, expert_parallel_size=2,
                                  strict_compile=True), loaded=mla, progress=False)
    return {"ref": ref, "ep": got, "compiles_after_warmup": sharded.stats().compilations_after_warmup,
            "devices": len(sharded.runner.kv.k.sharding.device_set),
            "lora_ref": lora_ref, "lora_ep": _generate(lora_ep, PROMPTS, "attn"),
            "lora_compiles_after_warmup": lora_ep.stats().compilations_after_warmup,
            "whole_experts": whole_found,
            "mla_lora_ref": mla_ref, "mla_lora_ep": _generate(mla_ep, PROMPTS, "attn"),
            "mla_lora_base": _generate(LLMEngine(EngineArgs(**ENGINE_ARGS, warmup=False), loaded=mla, progress=False),
                                       PROMPTS)}


def _attention_adapter(cfg) -> str:
    """A PEFT LoRA adapter directory (rank 4, random A and B) on the attention of every layer of `cfg` (q/k/v/o, or
    latent attention's projections), and on its experts' gate, up and down projections (per expert), router and shared
    expert when it has experts (a dense first layer's MLP is left alone)."""
    import tempfile

    import numpy as np
    from safetensors.numpy import save_file

    from jaxserve.models.lora import attention_targets, moe_targets, target_dims

    path, rng, dims, attention = tempfile.mkdtemp(), np.random.default_rng(3), target_dims(cfg), attention_targets(cfg)
    tensors = {}
    for layer in range(cfg.num_layers):
        moe = layer >= cfg.first_dense_layers
        for module in (*attention, *(moe_targets(cfg) if moe else ())):
            k, n = dims[module]
            where = "self_attn" if module in attention else "mlp"
            key = f"base_model.model.model.layers.{layer}.{where}.{module.replace('shared.', 'shared_expert.')}"
            tensors[key + ".lora_A.weight"] = rng.normal(0, 0.3, (4, k)).astype(np.float32)
            tensors[key + ".lora_B.weight"] = rng.normal(0, 0.3, (n, 4)).astype(np.float32)
        for e in range(cfg.num_experts if moe else 0):
            E, F = cfg.hidden_size, cfg.moe_intermediate_size
            for module, (k, n) in {"gate_proj": (E, F), "up_proj": (E, F), "down_proj": (F, E)}.items():
                key = f"base_model.model.model.layers.{layer}.mlp.experts.{e}.{module}"
                tensors[key + ".lora_A.weight"] = rng.normal(0, 0.3, (4, k)).astype(np.float32)
                tensors[key + ".lora_B.weight"] = rng.normal(0, 0.3, (n, 4)).astype(np.float32)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": list(attention)}, f)
    return path


def case_checkpoint() -> dict:
    """Save TP=2 parameters with orbax; restore them at TP=2 and on one device; a TP=8 plan is refused."""
    import tempfile

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.models.params import init_params, param_paths
    from sharding import ParallelConfig, make_mesh, make_plan
    from sharding.checkpoint import restore_params, save_params

    cfg = dense_config()
    params = init_params(cfg, jax.random.PRNGKey(0), scale=0.1)
    tp2 = make_plan(cfg, make_mesh(ParallelConfig(2)))
    one = make_plan(cfg, make_mesh(ParallelConfig(1)))
    saved = tp2.shard_params(params)
    path = tempfile.mkdtemp()
    save_params(path, saved, tp2.model_cfg)
    found = {}
    for name, plan in (("tp2", tp2), ("one", one)):
        got = param_paths(restore_params(path, plan, jnp.float32))
        want = param_paths(saved)
        found[name] = {
            "equal": all(np.array_equal(np.asarray(got[k]), np.asarray(want[k])) for k in want),
            "same_keys": sorted(got) == sorted(want),
            "wq_devices": len(got["layers.wq"].sharding.device_set),
            "wq_shard_heads": got["layers.wq"].addressable_shards[0].data.shape[2],
        }
    try:
        restore_params(path, make_plan(cfg, make_mesh(ParallelConfig(8))), jnp.float32)
        found["tp8_refused"] = ""
    except ValueError as e:
        found["tp8_refused"] = str(e)
    return found


def case_load() -> dict:
    """`load_model` places an HF checkpoint straight into its shards (dense at TP=4, MoE at TP=2 x EP=2)."""
    import tempfile

    import numpy as np

    from jaxserve.engine.model_loading import load_model
    from jaxserve.engine_args import EngineArgs
    from jaxserve.loader.export import export_hf
    from jaxserve.models.params import param_paths

    found = {}
    for name, cfg, tp, ep in (("dense", dense_config(), 4, 1), ("moe", moe_config("qwen2_moe"), 2, 2)):
        tiny = _tiny_loaded(cfg)
        path = tempfile.mkdtemp()
        export_hf(path, cfg, tiny.params, tiny.tokenizer)
        loaded = load_model(EngineArgs(model=path, tensor_parallel_size=tp, expert_parallel_size=ep,
                                       dtype="float32"), progress=False)
        got, want = param_paths(loaded.params), param_paths(tiny.params)
        repeat = loaded.plan.kv_repeat
        axis = {"layers.wk": 2, "layers.wv": 2, "layers.bk": 1, "layers.bv": 1}
        equal = all(np.allclose(np.asarray(got[k]), np.repeat(np.asarray(want[k]), repeat, axis=axis[k])
                                if k in axis else np.asarray(want[k])) for k in want)
        found[name] = {
            "equal": equal, "kv_repeat": repeat, "num_kv_heads": loaded.config.num_kv_heads,
            "devices": len(got["layers.wq"].sharding.device_set),
            "max_shard_fraction": max(x.addressable_shards[0].data.size / x.size for x in got.values()
                                      if x.sharding.spec != () and any(a is not None for a in x.sharding.spec)),
            "layout": repr(getattr(loaded.forward_fn, "keywords", {}).get("layout")),
        }
    return found


def case_quant() -> dict:
    """Weights quantized at load under TP=4 (KV heads repeated, int8) and EP=2 x TP=2 (a Qwen2-MoE model, fp8):
    the two steps' logits against one device's quantized model, the stored dtype, each value and scale array
    split like its weight; a model quantized on one device then laid out over TP=2: its logits too."""
    import tempfile

    import jax.numpy as jnp

    from jaxserve.engine.model_loading import load_model, shard_model
    from jaxserve.engine_args import EngineArgs
    from jaxserve.loader.export import export_hf
    from jaxserve.models.inputs import KVCache

    found = {}
    for name, cfg, method, tp, ep in (("dense", dense_config(), "int8", 4, 1), ("moe", moe_config(), "fp8", 2, 2)):
        tiny = _tiny_loaded(cfg)
        path = tempfile.mkdtemp()
        export_hf(path, cfg, tiny.params, tiny.tokenizer)
        args = EngineArgs(model=path, dtype="float32", quantization=method, **ENGINE_ARGS)
        single = load_model(args, progress=False)
        ref = _run_steps(single.config, single.params, KVCache.allocate(single.config, 16, 8, jnp.float32))
        placed = load_model(args.replace(tensor_parallel_size=tp, expert_parallel_size=ep), progress=False)
        plan = placed.plan
        got = _run_steps(plan.model_cfg, placed.params, plan.allocate_kv(16, 8, jnp.float32), plan)
        w = placed.params.layers.we_up if cfg.num_experts else placed.params.layers.wk
        found[name] = {
            "rel": max(_rel(got[0], ref[0]), _rel(got[1], ref[1])), "kv_repeat": plan.kv_repeat,
            "dtype": str(w.q.dtype), "q_spec": [str(a) for a in w.q.sharding.spec],
            "scale_spec": [str(a) for a in w.scale.sharding.spec], "scale_shape": list(w.scale.shape),
        }
        if not cfg.num_experts:  # quantized on one device, then laid out over TP=2 (as the engine does)
            laid = shard_model(single, args.replace(tensor_parallel_size=2))
            got = _run_steps(laid.config, laid.params, laid.plan.allocate_kv(16, 8, jnp.float32), laid.plan)
            found[name].update({"laid_rel": max(_rel(got[0], ref[0]), _rel(got[1], ref[1])),
                                "laid_wq_spec": [str(a) for a in laid.params.layers.wq.q.sharding.spec]})
            found["kept"] = _kept_int8_checkpoint(path, args.replace(quantization=None))
    return found


def _kept_int8_checkpoint(path: str, args) -> dict:
    """`path`'s projections written as a compressed-tensors int8 checkpoint (a scale per channel), held in int8
    on one device and under TP=4: the two steps' logits."""
    import json
    import os

    import jax.numpy as jnp
    import numpy as np
    from safetensors.numpy import load_file, save_file

    from jaxserve.engine.model_loading import load_model
    from jaxserve.models.inputs import KVCache

    file = os.path.join(path, "model.safetensors")
    tensors = {}
    for name, w in load_file(file).items():
        if name.endswith("_proj.weight"):
            scale = np.abs(w).max(1, keepdims=True) / 127.0
            tensors[name], tensors[name + "_scale"] = np.round(w / scale).astype(np.int8), scale.astype(np.float32)
        else:
            tensors[name] = w
    save_file(tensors, file)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {
        "g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    single = load_model(args, progress=False)
    ref = _run_steps(single.config, single.params, KVCache.allocate(single.config, 16, 8, jnp.float32))
    placed = load_model(args.replace(tensor_parallel_size=4), progress=False)
    got = _run_steps(placed.plan.model_cfg, placed.params, placed.plan.allocate_kv(16, 8, jnp.float32), placed.plan)
    wk = placed.params.layers.wk
    return {"rel": max(_rel(got[0], ref[0]), _rel(got[1], ref[1])), "held": [single.config.weight_quant,
            placed.config.weight_quant], "dtype": str(wk.q.dtype), "scale_spec": [str(a) for a in wk.scale.sharding.spec],
            "exact": bool(np.array_equal(np.asarray(single.params.layers.wq.q[0]).reshape(-1, tensors[
                "model.layers.0.self_attn.q_proj.weight"].shape[0]).T, tensors["model.layers.0.self_attn.q_proj.weight"]))}


def case_sleep() -> dict:
    """Sleep mode and weight updates on a TP=2 engine and on each replica of DP=2 x TP=2: the same tokens after
    waking (weights kept on the host, or read again from disk), new weights equal to one device on them."""
    import dataclasses
    import tempfile

    import jax

    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine_args import EngineArgs
    from jaxserve.loader.export import export_hf
    from jaxserve.models.params import init_params
    from sharding.data_parallel import DataParallelEngine

    cfg = dense_config()
    tiny = _tiny_loaded(cfg)
    paths = [tempfile.mkdtemp(), tempfile.mkdtemp()]
    export_hf(paths[0], cfg, tiny.params, tiny.tokenizer)
    export_hf(paths[1], cfg, init_params(cfg, jax.random.PRNGKey(1), scale=0.1), tiny.tokenizer)
    args = EngineArgs(model=paths[0], dtype="float32", enable_sleep_mode=True, **ENGINE_ARGS)
    ref = [_generate(LLMEngine(dataclasses.replace(args, model=p), progress=False), PROMPTS) for p in paths]
    tp2 = LLMEngine(dataclasses.replace(args, tensor_parallel_size=2, strict_compile=True), progress=False)
    found = {"ref_differ": ref[0] != ref[1], "tp2": [_generate(tp2, PROMPTS)]}
    for level in (1, 2):
        tp2.memory.sleep(level)
        found.setdefault("deleted", []).append(all(x.is_deleted() for x in jax.tree.leaves(tp2.runner.params)))
        tp2.memory.wake_up()
        found["tp2"].append(_generate(tp2, PROMPTS))
    tp2.memory.load_weights(paths[1])
    found["tp2"].append(_generate(tp2, PROMPTS))
    from safetensors.numpy import load_file  # tensors in memory go straight into their shards

    tp2.memory.load_weights(load_file(os.path.join(paths[0], "model.safetensors")))
    found["tp2"].append(_generate(tp2, PROMPTS))
    found["tp2_devices"] = len(jax.tree.leaves(tp2.runner.params)[0].sharding.device_set)
    found["tp2_compiles_after_warmup"] = tp2.stats().compilations_after_warmup
    dp = DataParallelEngine.from_engine_args(dataclasses.replace(args, tensor_parallel_size=2, data_parallel_size=2),
                                             start=False, progress=False)
    found["dp"] = []
    for replica in dp.replicas:
        e = replica.engine
        e.memory.sleep(2)
        e.memory.load_weights(paths[1])
        e.memory.wake_up()
        found["dp"].append([_generate(e, PROMPTS), sorted(d.id for d in e.runner.kv.k.sharding.device_set)])
    found["ref"] = ref
    return found


def case_images() -> dict:
    """A LLaVA model with images on TP=2 and on each replica of DP=2 x TP=2, against one device: the same tokens,
    nothing compiled after warmup; a Gemma 3 model (its images attended both ways) on TP=2."""
    import dataclasses
    import tempfile

    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine_args import EngineArgs
    from jaxserve.sampling_params import SamplingParams
    from sharding.data_parallel import DataParallelEngine
    from tests.gemma3_vision_model import save_tiny_gemma3
    from tests.llava_model import IMAGE_TOKEN, random_image, save_tiny_llava
    from tests.qwen2_vl_model import IMAGE_TOKEN as QWEN_IMAGE
    from tests.qwen2_vl_model import VISION_END, VISION_START, save_qwen_tokenizer, save_tiny_qwen2_vl

    path = tempfile.mkdtemp()
    save_tiny_llava(path)
    args = EngineArgs(model=path, dtype="float32", **{**ENGINE_ARGS, "max_model_len": 96})
    prompts = [[3, IMAGE_TOKEN, 4, 5], [IMAGE_TOKEN, 9, IMAGE_TOKEN, 8, 7]]
    images = [[random_image(1)], [random_image(2, (60, 20)), random_image(3)]]

    def generate(engine) -> list[list[int]]:
        greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        for i, (p, ims) in enumerate(zip(prompts, images, strict=True)):
            engine.add_request(str(i), p, greedy, multi_modal_data={"image": ims})
        outs: dict = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                outs[o.request_id] = list(o.outputs[0].token_ids)
        return [outs[str(i)] for i in range(len(prompts))]

    found = {"ref": generate(LLMEngine(args, progress=False))}
    tp2 = LLMEngine(dataclasses.replace(args, tensor_parallel_size=2, strict_compile=True), progress=False)
    found["tp2"] = generate(tp2)
    found["tp2_compiles_after_warmup"] = tp2.stats().compilations_after_warmup
    dp = DataParallelEngine.from_engine_args(dataclasses.replace(args, tensor_parallel_size=2, data_parallel_size=2),
                                             start=False, progress=False)
    found["dp"] = [generate(replica.engine) for replica in dp.replicas]
    # One embeddings cache for the replicas: the second found the first's three images.
    found["dp_cache_shared"] = dp.replicas[1].engine.images.cache is dp.replicas[0].engine.images.cache
    found["dp_stats"] = [r.engine.stats().mm_cache_hits for r in dp.replicas]
    gemma = tempfile.mkdtemp()
    save_tiny_gemma3(gemma)
    args = dataclasses.replace(args, model=gemma, max_num_batched_tokens=24, max_model_len=128)
    prompts[:] = ["<bos>t20 t21<start_of_image>t22", "<bos>t30<start_of_image>t31 t32 t33<start_of_image>t34"]
    found["gemma3_ref"] = generate(LLMEngine(dataclasses.replace(args, warmup=False), progress=False))
    gemma_tp2 = LLMEngine(dataclasses.replace(args, tensor_parallel_size=2, strict_compile=True), progress=False)
    found["gemma3_tp2"] = generate(gemma_tp2)
    found["gemma3_tp2_compiles_after_warmup"] = gemma_tp2.stats().compilations_after_warmup
    # Qwen2.5-VL: images of their own sizes, M-RoPE offsets in every step.
    qwen = tempfile.mkdtemp()
    save_tiny_qwen2_vl(qwen, "qwen2_5_vl")
    save_qwen_tokenizer(qwen)
    args = dataclasses.replace(args, model=qwen, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=256,
                               kv_cache_memory_bytes=2**20)
    image = [VISION_START, QWEN_IMAGE, VISION_END]
    prompts[:] = [[5, *image, 6, 7], [*image, 9, *image, 8]]
    images[:] = [[random_image(4, (80, 30))], [random_image(5, (31, 50)), random_image(6)]]
    found["qwen_ref"] = generate(LLMEngine(dataclasses.replace(args, warmup=False), progress=False))
    qwen_tp2 = LLMEngine(dataclasses.replace(args, tensor_parallel_size=2, strict_compile=True), progress=False)
    found["qwen_tp2"] = generate(qwen_tp2)
    found["qwen_tp2_compiles_after_warmup"] = qwen_tp2.stats().compilations_after_warmup
    return found


def hybrid_config():
    from jaxserve.config import ModelConfig

    # Granite 4.0-H's layers: Mamba-2 (8 heads of 16 channels, 2 groups) around one attention layer, 8 query heads.
    return ModelConfig.from_hf(dict(
        architectures=["GraniteMoeHybridForCausalLM"], model_type="granitemoehybrid", vocab_size=64, hidden_size=64,
        num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, num_local_experts=0,
        shared_intermediate_size=128, layer_types=["mamba", "attention", "mamba"], mamba_n_heads=8, mamba_d_head=16,
        mamba_d_state=16, mamba_n_groups=2, position_embedding_type="rope", max_position_embeddings=512))


def case_hybrid() -> dict:
    """A hybrid model through the engine, one device vs TP=2: its attention layer's heads split, its Mamba layers
    and their states whole on each device."""
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine_args import EngineArgs

    loaded = _tiny_loaded(hybrid_config())
    args = dict(ENGINE_ARGS, kv_cache_memory_bytes=2**20)
    ref = _generate(LLMEngine(EngineArgs(**args, warmup=False), loaded=loaded, progress=False), PROMPTS)
    tp2 = LLMEngine(EngineArgs(**args, tensor_parallel_size=2, strict_compile=True), loaded=loaded, progress=False)
    kv = tp2.runner.kv
    got = _generate(tp2, PROMPTS)
    return {"ref": ref, "tp2": got, "compiles_after_warmup": tp2.stats().compilations_after_warmup,
            "tp2_cached": [_generate(tp2, PROMPTS), tp2.scheduler.cache.hit_tokens],  # (from kept states)
            "pages_devices": len(kv.k.sharding.device_set), "pages_split": kv.k.sharding.shard_shape(kv.k.shape)[3],
            "ssm_whole": kv.ssm.sharding.shard_shape(kv.ssm.shape) == kv.ssm.shape,
            "dp2": _dp_hybrid(EngineArgs(**args, data_parallel_size=2, warmup=False), loaded),
            # Nemotron 3 Super (Nemotron-H with latent MoE blocks): its MLPs stacked apart, its ungated experts
            # split by width (TP) or over the two devices (EP), between its latent projections.
            "nemotron": _tp_tokens(args, dict(
                architectures=["NemotronHForCausalLM"], model_type="nemotron_h", vocab_size=64, hidden_size=64,
                hybrid_override_pattern="MEM*E", num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, n_routed_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=64, n_group=2,
                topk_group=1, max_position_embeddings=512, moe_latent_size=24), ep=True),
            # Qwen3-Next: its gated attention's heads (each query with its gate) split, its DeltaNet layers and
            # their states whole, its experts split by width or over the two devices, the shared expert's gate.
            "qwen3_next": _tp_tokens(args, dict(
                architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", vocab_size=64, hidden_size=64,
                num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
                num_attention_heads=8, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                max_position_embeddings=512), ep=True),
            # OLMo Hybrid: q and k normed over all their heads (split), norms by layer kind, beta doubled.
            "olmo_hybrid": _tp_tokens(args, dict(
                architectures=["OlmoHybridForCausalLM"], model_type="olmo_hybrid", vocab_size=64, hidden_size=64,
                num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
                num_attention_heads=8, num_key_value_heads=2, intermediate_size=96, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                max_position_embeddings=512)),
            # Falcon-H1: each layer's attention heads split beside its mixer, whole on each device.
            "falcon_h1": _tp_tokens(args, dict(
                architectures=["FalconH1ForCausalLM"], model_type="falcon_h1", vocab_size=64, hidden_size=64,
                num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=8, intermediate_size=96,
                mamba_d_ssm=64, mamba_n_heads=4, mamba_d_state=16, mamba_n_groups=2, mamba_rms_norm=True,
                key_multiplier=0.5, max_position_embeddings=512)),
            # Jamba: its Mamba layers (the selective scan) whole, its experts every other layer split by width (over
            # the devices: Nemotron's, Qwen3-Next's and Gemma 4's here, Maverick's in the MoE worker).
            "jamba": _tp_tokens(args, dict(
                architectures=["JambaForCausalLM"], model_type="jamba", vocab_size=64, hidden_size=64,
                num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, intermediate_size=96,
                attn_layer_period=2, attn_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=8,
                mamba_dt_rank=8, max_position_embeddings=512)),
            # LFM3 (LFM2's layers too): each head's one gate channel split with its query, its windowed layers beside
            # the full one, its short convolutions' states (no SSM state) whole.
            "lfm3": _tp_tokens(args, dict(
                architectures=["Lfm3ForCausalLM"], model_type="lfm3", vocab_size=64, hidden_size=64,
                num_hidden_layers=4, layer_types=["conv", "sliding_attention", "full_attention", "sliding_attention"],
                num_attention_heads=8, num_key_value_heads=2, head_dim=8, intermediate_size=96, sliding_window=8,
                conv_L_cache=3, max_position_embeddings=512)),
            "gemma4": _tp_tokens(args, GEMMA4_MOE, ep=True), "gemma4_small": _tp_tokens(args, GEMMA4_SMALL),
            # Phi (not hybrid either): its LM head's bias split with the vocabulary, attention and the MLP on one
            # LayerNorm with a bias.
            "phi": _tp_tokens(args, dict(
                architectures=["PhiForCausalLM"], model_type="phi", vocab_size=64, hidden_size=64, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=2, intermediate_size=96, partial_rotary_factor=0.5,
                max_position_embeddings=512)),
            # GPT-2: its learned positions whole on each device, its heads split.
            "gpt2": _tp_tokens(args, dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", vocab_size=64,
                                          n_embd=64, n_layer=2, n_head=8, n_positions=512))}


# Gemma 4 (not hybrid, run here for its helper): its full-attention layers' one KV head of 32, projected whole on each
# device and written twice into the pool's rows (4 heads of 16: 2 heads of 32 in view), one a device; experts beside
# the MLP split by width or over the two devices.
GEMMA4_MOE = dict(architectures=["Gemma4ForCausalLM"], model_type="gemma4_text", vocab_size=64, hidden_size=64,
                  intermediate_size=96, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                  global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8,
                  layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=0,
                  enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
                  max_position_embeddings=512)
# ... and E2B/E4B's form: one KV head of 16 (widened to one a device) in rows of 32, each layer's own input, the last
# two layers attending over earlier layers' pages, their MLPs twice as wide.
GEMMA4_SMALL = dict(GEMMA4_MOE, num_hidden_layers=6, layer_types=["sliding_attention", "full_attention"] * 3,
                    num_key_value_heads=1, attention_k_eq_v=False, num_global_key_value_heads=None,
                    enable_moe_block=False, hidden_size_per_layer_input=8, vocab_size_per_layer_input=64,
                    num_kv_shared_layers=2, use_double_wide_mlp=True)


def _tp_tokens(args: dict, hf_config: dict, ep: bool = False) -> list[list[list[int]]]:
    """A hybrid model's greedy tokens (random weights of `hf_config`) on one device, at TP=2 and, with `ep`, with its
    experts over the two devices."""
    from jaxserve.config import ModelConfig
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine_args import EngineArgs

    loaded = _tiny_loaded(ModelConfig.from_hf(hf_config))
    runs = ((1, False), (2, False)) + (((2, True),) if ep else ())
    return [_generate(LLMEngine(EngineArgs(**args, tensor_parallel_size=tp, enable_expert_parallel=with_ep,
                                           warmup=False), loaded=loaded, progress=False), PROMPTS)
            for tp, with_ep in runs]


def _dp_hybrid(args, loaded) -> list[list[int]]:
    from sharding import DataParallelEngine

    dp = DataParallelEngine.from_engine_args(args, loaded=loaded, progress=False)
    tokens, _ = _dp_generate(dp, PROMPTS)
    dp.shutdown()
    return tokens


def _dp_generate(dp, prompts) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens of `prompts` from a data-parallel engine, all requests at once, and the replica each went to."""
    import asyncio

    from jaxserve.sampling_params import SamplingParams

    placed: dict[int, int] = {}
    tokens: dict[int, list[int]] = {}

    async def one(i: int, prompt: list[int]) -> None:
        async for out in dp.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), f"r{i}"):
            placed.setdefault(i, dp.replica_of(f"r{i}"))
            if out.finished:
                tokens[i] = out.outputs[0].token_ids

    async def main() -> None:
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    asyncio.run(main())
    dp.check_integrity()
    return [tokens[i] for i in range(len(prompts))], [placed[i] for i in range(len(prompts))]


CASES = {"hybrid": case_hybrid, "quant": case_quant, "images": case_images, "sleep": case_sleep, "load": case_load, "checkpoint": case_checkpoint, "dense": case_dense, "moe": case_moe, "engine": case_engine, "dp": case_dp, "engine_moe": case_engine_moe,
         "draft": case_draft, "mtp": case_mtp, "eagle": case_eagle}


def main(argv: list[str]) -> None:
    import jax

    jax.config.update("jax_compilation_cache_dir", os.path.expanduser("~/.cache/jaxserve/jax-tests"))
    results = {}
    for name in argv:
        t0 = time.perf_counter()
        results[name] = CASES[name]()
        results[name + "_seconds"] = time.perf_counter() - t0
    print(RESULT_PREFIX + json.dumps(results), flush=True)


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:  # what the cases write goes, and goes away, with it
        tempfile.tempdir = scratch
        main(sys.argv[1:])
