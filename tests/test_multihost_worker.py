"""One process of a 2-process CPU cluster on 127.0.0.1 (see tests/test_multihost.py).

Run as `python -m tests.test_multihost_worker PROCESS_ID PORT WORKDIR`; prints its findings as JSON. Files it
writes (checkpoints, adapters) go under WORKDIR, which the parent test owns.
"""

from __future__ import annotations

import json
import sys

RESULT_PREFIX = "RESULT:"


def main(process_id: int, port: int, workdir: str) -> None:
    import os
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.models.params import init_params
    from sharding import ParallelConfig, make_mesh, make_plan
    from sharding.distributed import broadcast_message, host_value, initialize_distributed
    from tests.test_sharding_worker import _steps, dense_config

    jax.config.update("jax_compilation_cache_dir", os.path.expanduser("~/.cache/jaxserve/jax-tests"))
    share_cpu_compile_cache()
    t0 = time.perf_counter()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    initialize_distributed(f"127.0.0.1:{port}", 2, process_id)
    t_init = time.perf_counter() - t0
    cfg = dense_config()
    mesh = make_mesh(ParallelConfig(tensor_parallel_size=2))
    plan = make_plan(cfg, mesh)
    # Same seed on both hosts; each one reads only the slices its own device holds.
    params = plan.shard_params(init_params(cfg, jax.random.PRNGKey(0), scale=0.1))
    kv = plan.allocate_kv(16, 8, jnp.float32)
    import functools

    from jaxserve.models.llama import forward

    sh = plan.step_shardings()
    step = jax.jit(functools.partial(forward, cfg=plan.model_cfg, backend="xla"), donate_argnums=(1,),
                   in_shardings=(sh.params, sh.kv, sh.replicated), out_shardings=(sh.replicated, sh.kv))
    logits = []
    for inputs in _steps():
        inputs = jax.tree.map(np.asarray, inputs)
        out, kv = step(params, kv, inputs)
        logits.append(host_value(out)[: int(inputs.query_start_loc[-1])].tolist())
    message = broadcast_message({"from": process_id, "work": [1, 2, 3]})
    # Longer than one chunk: it takes several collectives, and arrives whole.
    big = broadcast_message({"from": process_id, "blob": "ab" * 100_000} if process_id == 0 else None)
    found = {
        "process_index": jax.process_index(), "process_count": jax.process_count(),
        "global_devices": jax.device_count(), "local_devices": jax.local_device_count(),
        "wq_local_shards": len(params.layers.wq.addressable_shards),
        "logits": logits, "broadcast": message, "init_s": t_init,
        "big_broadcast": [big["from"], len(big["blob"]), big["blob"][:4]],
    }
    found.update(serve_draft(process_id))
    found.update(serve_lora(process_id, workdir))
    found.update(serve_images(process_id, workdir))
    found.update(serve_hybrid(process_id))
    found["total_s"] = time.perf_counter() - t0
    print(RESULT_PREFIX + json.dumps(found), flush=True)
    jax.distributed.shutdown()


def share_cpu_compile_cache() -> None:
    """Give both processes one compilation cache key per program, so process 1 reads what process 0 wrote.

    JAX writes the persistent cache from process 0 only, and on the CPU each process's key hashes its own topology
    fingerprint (on GPUs the key is made the same on every process), so process 1 missed every entry and compiled
    every program again on each run: about 70 s of CPU. Hashing the device kinds instead (JAX's own fallback for
    backends without a topology) makes the keys equal; the executables are the ones JAX itself shares between hosts.
    """
    from jax._src import cache_key

    if hasattr(cache_key, "_hash_accelerator_config") and hasattr(cache_key, "_hash_devices"):
        cache_key._hash_accelerator_config = cache_key._hash_devices


def serve_hybrid(process_id: int) -> dict:
    """A hybrid model (`test_sharding_worker.hybrid_config`) on the lock-step TP=2 engine: each process keeps the
    Mamba layers' states of the slots its own scheduler gives, alike on both; process 0 takes the requests."""
    from jaxserve.engine_args import EngineArgs
    from jaxserve.sampling_params import SamplingParams
    from sharding.distributed import LockstepEngine
    from tests.test_sharding_worker import ENGINE_ARGS, PROMPTS, _tiny_loaded, hybrid_config

    args = EngineArgs(**{**ENGINE_ARGS, "kv_cache_memory_bytes": 2**20, "warmup": False}, tensor_parallel_size=2)
    engine = LockstepEngine(args, loaded=_tiny_loaded(hybrid_config()), progress=False)
    if process_id == 0:
        for i, p in enumerate(PROMPTS):
            engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    finished = engine.run_until_idle()
    return {"hybrid_tokens": [finished[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))] if finished else []}


def serve_draft(process_id: int) -> dict:
    """The lock-step TP=2 engine with a draft model (the model drafting for itself, read from a checkpoint each host
    writes of it), whole on both hosts' devices; process 0 takes the request."""
    import tempfile

    from jaxserve.engine_args import EngineArgs
    from jaxserve.loader.export import export_hf
    from jaxserve.sampling_params import SamplingParams
    from sharding.distributed import LockstepEngine
    from tests.test_sharding_worker import ENGINE_ARGS, PROMPTS, _tiny_loaded, dense_config

    loaded = _tiny_loaded(dense_config())
    with tempfile.TemporaryDirectory() as path:
        export_hf(path, loaded.config, loaded.params, loaded.tokenizer)
        args = EngineArgs(**{**ENGINE_ARGS, "max_num_seqs": 4}, tensor_parallel_size=2, strict_compile=True,
                          speculative_config={"model": path, "num_speculative_tokens": 3})
        engine = LockstepEngine(args, loaded=loaded, progress=False)
    if process_id == 0:
        engine.add_request("0", PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    finished = engine.run_until_idle()
    stats = engine.stats()
    return {"draft_tokens": [finished["0"].outputs[0].token_ids] if finished else [],
            "draft_counts": [stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens],
            "draft_costs_measured": engine.drafter.costs is not None,
            "draft_compiles_after_warmup": stats.compilations_after_warmup}


def lora_requests(adapter_b: str) -> list[tuple[str, object]]:
    """The LoRA case's requests: adapter "a" (loaded at start-up), the base model, and adapter "b" loaded on
    first use (one adapter slot, so b waits for a's request and takes its slot)."""
    from jaxserve.lora_request import LoRARequest

    return [("a", "a"), ("base", None), ("b", LoRARequest("b", 2, adapter_b))]


def serve_lora(process_id: int, workdir: str) -> dict:
    """The lock-step TP=2 engine with LoRA adapters: one known at start-up (each process reads its own copy),
    one loaded when a request names it on process 0 (the others load it from the same path)."""
    from jaxserve.engine_args import EngineArgs
    from jaxserve.sampling_params import SamplingParams
    from sharding.distributed import LockstepEngine
    from tests.lora_tp_worker import tiny_adapter
    from tests.test_sharding_worker import ENGINE_ARGS, PROMPTS, _tiny_loaded, dense_config

    cfg = dense_config()
    own = f"{workdir}/p{process_id}/a"
    tiny_adapter(cfg, own, seed=1)
    shared = f"{workdir}/b"
    if process_id == 0:  # written before process 0 takes the request that names it
        tiny_adapter(cfg, shared, seed=2)
    args = EngineArgs(**{**ENGINE_ARGS, "max_num_seqs": 1}, tensor_parallel_size=2, strict_compile=True,
                      enable_lora=True, max_loras=1, max_lora_rank=8, lora_modules=(("a", own),))
    engine = LockstepEngine(args, loaded=_tiny_loaded(cfg), progress=False)
    if process_id == 0:
        for name, lora in lora_requests(shared):
            engine.add_request(name, PROMPTS[1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                               lora_request=lora)
    finished = engine.run_until_idle()
    return {"lora_tokens": {k: v.outputs[0].token_ids for k, v in finished.items()} if finished else {},
            "lora_slots": list(engine.loras.slots), "lora_known": sorted(engine.loras.paths),
            "lora_compiles_after_warmup": engine.stats().compilations_after_warmup, "lora_b_path": shared}


def image_requests():
    """The images case's prompts (placeholders) and images: one image, then two side by side."""
    from tests.llava_model import IMAGE_TOKEN, random_image

    return [([3, IMAGE_TOKEN, 4, 5], [random_image(1)]),
            ([9, IMAGE_TOKEN, IMAGE_TOKEN, 8], [random_image(2, (60, 20)), random_image(3)])]


# No warmup: only the buckets the requests use are compiled (the other cases check compiles after warmup).
IMAGE_ENGINE_ARGS = dict(max_num_seqs=1, max_num_batched_tokens=16, max_model_len=96, page_size=8,
                         kv_cache_memory_bytes=2**20, num_scheduler_steps=4, compile_cache_dir=None, dtype="float32",
                         warmup=False)


def serve_images(process_id: int, workdir: str) -> dict:
    """A LLaVA model (each process saves the same seeded copy) on the lock-step TP=2 engine: process 0 reads the
    images, the other process gets their pixels in the step message and encodes them on its own device."""
    from jaxserve.engine_args import EngineArgs
    from jaxserve.sampling_params import SamplingParams
    from sharding.distributed import LockstepEngine
    from tests.llava_model import save_tiny_llava

    path = f"{workdir}/p{process_id}/llava"
    save_tiny_llava(path)
    engine = LockstepEngine(EngineArgs(model=path, tensor_parallel_size=2, **IMAGE_ENGINE_ARGS), progress=False)
    if process_id == 0:
        for i, (prompt, images) in enumerate(image_requests()):
            engine.add_request(f"img{i}", prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                               multi_modal_data={"image": images})
    finished = engine.run_until_idle()
    return {"image_tokens": [finished[f"img{i}"].outputs[0].token_ids for i in range(2)] if finished else [],
            "image_encoder_queries": engine.images.cache_queries}


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
