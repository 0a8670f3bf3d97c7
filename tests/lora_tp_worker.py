"""LoRA under tensor parallelism, run in a child process with 8 simulated CPU devices (see
`tests.test_sharding_worker.run_module`): `python -m tests.lora_tp_worker` prints its findings as JSON."""

from __future__ import annotations

import json
import os
import tempfile

from tests.test_sharding_worker import ENGINE_ARGS, PROMPTS, RESULT_PREFIX, _tiny_loaded, dense_config


def tiny_adapter(cfg, path: str, rank: int = 4, seed: int = 1) -> None:
    """A PEFT LoRA adapter directory on all seven projections of `cfg`, random A and B."""
    import numpy as np
    from safetensors.numpy import save_file

    from jaxserve.models.lora import target_dims

    rng, tensors = np.random.default_rng(seed), {}
    for layer in range(cfg.num_layers):
        for module, (k, n) in target_dims(cfg).items():
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[key + ".lora_A.weight"] = rng.normal(0, 0.3, (rank, k)).astype(np.float32)
            tensors[key + ".lora_B.weight"] = rng.normal(0, 0.3, (n, rank)).astype(np.float32)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(target_dims(cfg))}, f)


def main() -> dict:
    """An adapter's requests beside the base model's, greedy, on one device, TP=2 (KV heads split) and TP=4
    (KV heads repeated); compiles after warmup."""
    import jax

    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine_args import EngineArgs
    from jaxserve.sampling_params import SamplingParams

    jax.config.update("jax_compilation_cache_dir", os.path.expanduser("~/.cache/jaxserve/jax-tests"))
    cfg = dense_config()
    loaded = _tiny_loaded(cfg)
    path = os.path.join(tempfile.mkdtemp(), "a")
    tiny_adapter(cfg, path)
    found = {}
    for tp in (1, 2, 4):
        args = dict(ENGINE_ARGS, kv_cache_memory_bytes=1 << 20, tensor_parallel_size=tp, strict_compile=True,
                    enable_lora=True, max_loras=2, max_lora_rank=8, lora_modules=(("a", path),))
        engine = LLMEngine(EngineArgs(**args), loaded=loaded, progress=False)
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        for i, p in enumerate(PROMPTS):
            engine.add_request(f"a{i}", p, params, lora_request="a")
            engine.add_request(f"b{i}", p, params)
        final = {}
        while engine.has_unfinished_requests():
            final.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
        engine.check_integrity()
        found[f"tp{tp}"] = {"adapter": [final[f"a{i}"] for i in range(len(PROMPTS))],
                            "base": [final[f"b{i}"] for i in range(len(PROMPTS))],
                            "compiles_after_warmup": engine.stats().compilations_after_warmup,
                            "devices": len(engine.runner.kv.k.sharding.device_set),
                            "kv_repeat": engine.model.plan.kv_repeat if engine.model.plan else 1}
    return found


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as scratch:  # the adapter it writes goes, and goes away, with it
        tempfile.tempdir = scratch
        print(RESULT_PREFIX + json.dumps(main()), flush=True)
