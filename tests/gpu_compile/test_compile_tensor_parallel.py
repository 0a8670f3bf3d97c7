"""The model's step under tensor parallelism over two H200s (a deviceless topology), on the Pallas kernels: each
device runs the attention kernels on its own heads and pages (`jaxserve.models.head_shards`), so the step holds
the same collectives as on the XLA path (an all-reduce after the attention and after the MLP), and never gathers
a pool.

A kernel is opaque to XLA's partitioner: called on sharded arrays without a per-device map, it gathers every
device's queries and pages into each device, a whole pool a layer (the last test shows what that costs).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.config import ModelConfig
from jaxserve.models.inputs import KVCache, ModelInputs
from jaxserve.models.llama import forward
from jaxserve.models.params import abstract_params
from tests.gpu_compile.test_compile_mla import V2_LITE

pytestmark = pytest.mark.gpu_compile

# Llama-3-8B's attention and widths, two layers.
LLAMA = ModelConfig.from_hf({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 8192, "rope_theta": 500000.0})
NUM_PAGES, PAGE, T, S = 16384, 16, 512, 64


def _compile(cfg: ModelConfig, backend: str, per_device: bool = True):
    """(HLO text, memory analysis, one device's pool bytes) of `forward` at TP=2."""
    from jax.experimental import topologies

    from sharding import ParallelConfig, make_mesh, make_plan
    from tests.gpu_compile.conftest import h200_target_config

    jax.config.update("jax_enable_compilation_cache", False)
    topo = topologies.get_topology_desc("h200", "cuda", target_config=h200_target_config(), topology="1x1x2")
    mesh = make_mesh(ParallelConfig(2, 1), topo.devices[:2])
    plan = make_plan(cfg, mesh)
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract_params(plan.model_cfg, jnp.bfloat16), plan.param_shardings())
    pool = jax.eval_shape(lambda: KVCache.allocate(plan.model_cfg, NUM_PAGES, PAGE, jnp.bfloat16))
    kv = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=plan.kv_sharding()), pool)
    host = ModelInputs.build([([0], 0, [0])], PAGE, num_tokens=T, num_seqs=S, pages_per_seq=128)
    whole = NamedSharding(mesh, P())
    inputs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype, sharding=whole), host)
    assert plan.layout().head_axis == "model"
    layout = plan.layout() if per_device else None
    step = functools.partial(forward, cfg=plan.model_cfg, backend=backend, layout=layout)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        compiled = jax.jit(step, donate_argnums=(1,)).trace(params, kv, inputs).lower().compile()
    pool_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(pool)) // 2
    return compiled.as_text(), compiled.memory_analysis(), pool_bytes


def test_decode_loop_on_each_devices_heads():
    """The engine's on-device decode loop (64 rows, the kernels' decode batches in a while loop) at TP=2: the
    XLA path's collectives (its all-gathers are the vocabulary-split logits' and their top-k's) and temporaries,
    no pool gathered."""
    from jax.experimental import topologies

    from jaxserve.engine.penalties import PenaltyInputs
    from jaxserve.engine.runner import decode_loop
    from jaxserve.engine.sampler import SamplingTensors
    from sharding import ParallelConfig, make_mesh, make_plan
    from tests.gpu_compile.conftest import h200_target_config
    from tests.gpu_compile.test_compile_engine import RC, _abstract, decode_state

    topo = topologies.get_topology_desc("h200", "cuda", target_config=h200_target_config(), topology="1x1x2")
    mesh = make_mesh(ParallelConfig(2, 1), topo.devices[:2])
    plan = make_plan(LLAMA, mesh)
    whole = NamedSharding(mesh, P())

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=whole)

    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract_params(plan.model_cfg, jnp.bfloat16), plan.param_shardings())
    pool = jax.eval_shape(lambda: KVCache.allocate(plan.model_cfg, NUM_PAGES, RC.page_size, jnp.bfloat16))
    kv = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=plan.kv_sharding()), pool)
    S = 64
    sampling = _abstract(spec, SamplingTensors.from_params([], [], S, LLAMA.vocab_size, []))
    pen = PenaltyInputs(spec((S, RC.max_model_len), jnp.int32), spec((S,), jnp.int32))
    texts, temps = {}, {}
    for backend in ("xla", "pallas"):
        loop = functools.partial(decode_loop, cfg=plan.model_cfg, backend=backend, top_k=RC.max_logprobs,
                                 n_max=RC.num_scheduler_steps,
                                 model_fn=functools.partial(forward, layout=plan.layout()))
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            compiled = jax.jit(loop, donate_argnums=(1,)).trace(
                params, kv, decode_state(spec, S), sampling, pen, spec((), jnp.bool_)).lower().compile()
        texts[backend], temps[backend] = compiled.as_text(), compiled.memory_analysis().temp_size_in_bytes
    assert "triton" in texts["pallas"].lower()
    assert _collectives(texts["pallas"]) == _collectives(texts["xla"])
    assert temps["pallas"] <= 1.01 * temps["xla"], temps


def _collectives(text: str) -> dict[str, int]:
    ops: dict[str, int] = {}
    for op in re.findall(r" (all-gather|all-reduce|all-to-all|collective-permute)(?:-start)?\(", text):
        ops[op] = ops.get(op, 0) + 1
    return ops


@pytest.mark.parametrize("cfg,backend", [(LLAMA, "pallas"), (LLAMA, "pallas_mosaic"), (V2_LITE, "pallas")],
                         ids=["llama-pallas", "llama-pallas_mosaic", "deepseek_v2-pallas"])
def test_kernels_run_on_each_devices_heads(cfg, backend):
    """The kernels' step holds the XLA path's collectives and temporaries (Llama-3-8B's: 189 MB a device beside
    a 1.07 GB pool; DeepSeek-V2-Lite's 116 MB beside 0.6 GB of latents)."""
    text, mem, pool_bytes = _compile(cfg, backend)
    assert ("triton" in text.lower()) if backend == "pallas" else ('custom_call_target="mosaic_gpu' in text)
    xla_text, xla_mem, _ = _compile(cfg, "xla")
    assert _collectives(text) == _collectives(xla_text) and set(_collectives(text)) == {"all-reduce"}
    assert mem.alias_size_in_bytes >= pool_bytes, "the pool is not updated in place"
    assert mem.temp_size_in_bytes <= 1.01 * xla_mem.temp_size_in_bytes, (mem.temp_size_in_bytes,
                                                                         xla_mem.temp_size_in_bytes)


def test_without_the_per_device_map_the_pool_is_gathered():
    """What the per-device map prevents: the same step with the kernel called on the sharded arrays as they are
    gathers the pools: 4.3 GB of temporaries a device beside its 1.07 GB pool (the XLA path: 189 MB)."""
    text, mem, pool_bytes = _compile(LLAMA, "pallas", per_device=False)
    assert _collectives(text).get("all-gather", 0) >= 2
    assert mem.temp_size_in_bytes >= pool_bytes
