"""Two processes on 127.0.0.1 form one CPU cluster (jax.distributed, gloo collectives): a TP=2 model
split across them gives the single-process logits, process 0's step message reaches both, and a
lock-step TP=2 engine across them serves requests with the single-device engine's greedy tokens."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models.inputs import KVCache
from jaxserve.models.params import init_params
from tests.test_multihost_worker import RESULT_PREFIX
from tests.test_sharding_worker import ROOT, _rel, _run_steps, dense_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> list[dict]:
    port, workdir = free_port(), str(tmp_path_factory.mktemp("cluster"))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    procs = [subprocess.Popen([sys.executable, "-m", "tests.test_multihost_worker", str(i), str(port), workdir], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=900)  # (cold compilation cache: 200 s)
            lines = [ln for ln in out.splitlines() if ln.startswith(RESULT_PREFIX)]
            assert p.returncode == 0 and lines, f"process failed (rc {p.returncode}):\n{out[-2000:]}\n{err[-4000:]}"
            outs.append(json.loads(lines[-1][len(RESULT_PREFIX):]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


def test_two_processes_form_one_cluster(cluster):
    assert [r["process_index"] for r in cluster] == [0, 1]
    assert all(r["process_count"] == 2 and r["global_devices"] == 2 and r["local_devices"] == 1 for r in cluster)
    assert all(r["wq_local_shards"] == 1 for r in cluster)  # each host holds only its half of the heads


def test_tp2_across_processes_gives_single_process_logits(cluster):
    cfg = dense_config()
    params = init_params(cfg, jax.random.PRNGKey(0), scale=0.1)
    ref = _run_steps(cfg, params, KVCache.allocate(cfg, 16, 8, jnp.float32))
    for r in cluster:
        for got, want in zip(r["logits"], ref, strict=True):
            assert _rel(np.asarray(got, np.float32), want) < 1e-5


def test_step_message_is_broadcast_from_process_0(cluster):
    assert [r["broadcast"] for r in cluster] == [{"from": 0, "work": [1, 2, 3]}] * 2
    assert [r["big_broadcast"] for r in cluster] == [[0, 200_000, "abab"]] * 2


def test_lockstep_engine_across_processes_serves_single_device_tokens(cluster):
    """The lock-step TP=2 engine with a draft model (the model drafting for itself, `serve_draft`): only process 0
    received the request; both processes produced it, step for step, with the single-device engine's tokens."""
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine_args import EngineArgs
    from tests.test_sharding_worker import ENGINE_ARGS, PROMPTS, _generate, _tiny_loaded

    ref = _generate(LLMEngine(EngineArgs(**ENGINE_ARGS, warmup=False), loaded=_tiny_loaded(dense_config()),
                              progress=False), PROMPTS[:1])
    assert [r["draft_tokens"] for r in cluster] == [ref, ref]


def test_a_hybrid_model_across_processes_serves_single_device_tokens(cluster):
    """Granite 4.0-H's layers over the two processes' devices (attention heads split, Mamba layers whole on each,
    each process's state slots given by its own scheduler in lock-step): one device's greedy tokens."""
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine_args import EngineArgs
    from tests.test_sharding_worker import ENGINE_ARGS, PROMPTS, _generate, _tiny_loaded, hybrid_config

    args = EngineArgs(**{**ENGINE_ARGS, "kv_cache_memory_bytes": 2**20, "warmup": False})
    ref = _generate(LLMEngine(args, loaded=_tiny_loaded(hybrid_config()), progress=False), PROMPTS)
    assert len(ref) == 3 and [r["hybrid_tokens"] for r in cluster] == [ref, ref]


def test_a_draft_model_across_processes_drafts_alike_on_both(cluster):
    # Both hosts drafted alike (the drafts are the same on each); the model drafting for itself is nearly always
    # right (its draft whole on each device, the target split over two: sums in another order). No host weighed its
    # drafts by step times it measured itself: those differ between hosts, and so would their steps.
    assert [r["draft_costs_measured"] for r in cluster] == [False, False]
    assert cluster[0]["draft_counts"] == cluster[1]["draft_counts"]
    drafted, accepted = cluster[0]["draft_counts"]
    assert drafted >= 6 and accepted >= drafted - 2
    assert all(r["draft_compiles_after_warmup"] == 0 for r in cluster)


def test_images_across_processes_serve_single_device_tokens(cluster, tmp_path):
    """Images on the lock-step cluster: process 0 reads them and sends their pixels with the request; each process
    encodes them on its own device, and both serve the single-device engine's tokens."""
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine_args import EngineArgs
    from jaxserve.sampling_params import SamplingParams
    from tests.llava_model import save_tiny_llava
    from tests.test_multihost_worker import IMAGE_ENGINE_ARGS, image_requests

    save_tiny_llava(tmp_path)
    engine = LLMEngine(EngineArgs(model=str(tmp_path), **IMAGE_ENGINE_ARGS), progress=False)
    for i, (prompt, images) in enumerate(image_requests()):
        engine.add_request(f"img{i}", prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                           multi_modal_data={"image": images})
    ref = {}
    while engine.has_unfinished_requests():
        ref.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
    want = [ref["img0"], ref["img1"]]
    assert [r["image_tokens"] for r in cluster] == [want, want]
    assert [r["image_encoder_queries"] for r in cluster] == [3, 3]  # each process encoded the three images


def test_lora_adapters_across_processes_serve_single_device_tokens(cluster, tmp_path):
    """LoRA on the lock-step cluster: an adapter known at start-up, one process 0 loads when a request names
    it (the other process loads it at the same step), one slot handed from a to b, as on one device."""
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine_args import EngineArgs
    from jaxserve.sampling_params import SamplingParams
    from tests.lora_tp_worker import tiny_adapter
    from tests.test_multihost_worker import lora_requests
    from tests.test_sharding_worker import ENGINE_ARGS, PROMPTS, _generate, _tiny_loaded

    cfg = dense_config()
    tiny_adapter(cfg, str(tmp_path / "a"), seed=1)
    engine = LLMEngine(EngineArgs(**{**ENGINE_ARGS, "max_num_seqs": 1}, enable_lora=True, max_loras=1,
                                  max_lora_rank=8, lora_modules=(("a", str(tmp_path / "a")),)),
                       loaded=_tiny_loaded(cfg), progress=False)
    for name, lora in lora_requests(cluster[0]["lora_b_path"]):
        engine.add_request(name, PROMPTS[1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                           lora_request=lora)
    ref = {}
    while engine.has_unfinished_requests():
        ref.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
    assert [r["lora_tokens"] for r in cluster] == [ref, ref]
    assert len({tuple(t) for t in ref.values()}) == 3  # each adapter, and the base model, writes its own
    assert [r["lora_slots"] for r in cluster] == [["b"], ["b"]] and [r["lora_known"] for r in cluster] == [["a", "b"]] * 2
    assert all(r["lora_compiles_after_warmup"] == 0 for r in cluster)
    assert ref["base"] == _generate(LLMEngine(EngineArgs(**ENGINE_ARGS), loaded=_tiny_loaded(cfg), progress=False),
                                    [PROMPTS[1]], max_tokens=8)[0]
