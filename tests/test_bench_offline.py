"""The offline benchmark's accounting on the engine around a counting model; its targets and bytes."""

from __future__ import annotations

import numpy as np
import pytest

from bench.machine import Bandwidth, measure_bandwidth, measure_device_bandwidth
from bench.offline import StepProbe, decode_bytes_per_step, drive, evaluate_targets, format_report
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine_args import EngineArgs
from jaxserve.sampling_params import SamplingParams
from tests.fake_model import fake_loaded_model

ARGS = EngineArgs(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128, page_size=8,
                  kv_cache_memory_bytes=64 * 2 * 8 * 4 * 4, num_scheduler_steps=4, compile_cache_dir=None)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(ARGS, loaded=fake_loaded_model(), progress=False)


def test_drive_splits_step_time_and_counts_decode_steps(engine):
    probe = StepProbe(engine.runner)
    prompts = [[5, 6, 7], [9, 10], [11, 12, 13, 14]]
    st = drive(engine, probe, prompts, SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True), "t")
    assert st.output_tokens == 27 and st.prompt_tokens == 9 and st.num_requests == 3
    # The prefill step samples the first token; 8 more come from two decode loops of 4 steps.
    assert st.mixed_calls == 1 and st.decode_calls == 2 and st.decode_steps == 8
    assert st.engine_steps == 3
    assert 0 < st.runner_s <= st.step_wall_s <= st.wall_s
    assert 0.0 <= st.host_share < 1.0
    assert st.decode_step_s == pytest.approx(st.decode_s / 8)
    assert len(st.ttft_s) == 3
    assert engine.stats().compilations_after_warmup == 0
    assert not engine.has_unfinished_requests()


def test_decode_bytes_follow_the_params_and_the_kv_layout(engine):
    weights, kv = decode_bytes_per_step(engine, [10, 20, 30])
    params = engine.model.params
    import jax

    assert weights == sum(x.nbytes for x in jax.tree.leaves(params))  # tied embeddings: all read
    cfg = engine.model.config
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # K and V, float32
    assert kv == pytest.approx(20 * per_token)


def _result_with(bandwidth: dict) -> dict:
    return {
        "model": {"name": "m", "dtype": "float32"}, "machine": {"usable_cores": 2, "cpu": "cpu"},
        "bandwidth": bandwidth,
        "batch1": {"num_requests": 1, "output_tokens": 128, "wall_s": 4.0, "output_tok_s": 32.0,
                   "decode_step_s": 0.03, "host_share": 0.02, "mean_ttft_s": 0.1, "weight_bytes": 400e6,
                   "kv_bytes_mean": 8e6, "floor_step_s": 0.0255, "floor_ratio": 0.03 / 0.0255},
        "runs": [{"concurrency": 32, "num_requests": 32, "output_tokens": 4096, "wall_s": 10.0,
                  "output_tok_s": 409.6, "decode_step_s": 0.05, "host_share": 0.12, "mean_ttft_s": 1.0}],
        "compilations_after_warmup": 0, "num_preemptions": 0,
    }


def test_targets_and_report():
    result = _result_with(Bandwidth(10e9, 12e9, 16e9, 2, 1 << 20).to_dict())
    t = evaluate_targets(result)
    assert t["batch1_floor_ratio"]["met"] and t["compilations_after_warmup"]["met"]
    assert t["speedup_32_over_batch1"]["value"] == pytest.approx(12.8) and t["speedup_32_over_batch1"]["met"]
    assert not t["host_share_32"]["met"]
    result["targets"] = t
    text = format_report(result)
    assert "floor 25.50 ms" in text and "NOT met" in text and "16.0 GB/s" in text


def test_bandwidth_measurement_is_plausible():
    bw = measure_bandwidth(16 << 20, repeats=2, threads=2)
    assert bw.buffer_bytes == 16 << 20 and bw.threads == 2
    assert 1e8 < bw.best < 1e12  # between 0.1 GB/s and 1 TB/s
    assert bw.best == max(bw.read_1thread, bw.read_all_threads, bw.copy_1thread)
    assert np.isfinite(bw.read_all_threads)


def test_device_bandwidth_and_its_report_line():
    bw = measure_device_bandwidth(16 << 20, repeats=2)
    assert bw.memory == "cpu" and bw.buffer_bytes == 16 << 20
    assert 1e8 < bw.best < 1e13 and bw.best == max(bw.read_1thread, bw.copy_1thread)
    gpu = Bandwidth(4.0e12, 4.0e12, 4.3e12, 1, 1 << 30, memory="gpu").to_dict()
    result = {**_result_with(gpu), "device": "NVIDIA H200"}
    result["targets"] = evaluate_targets(result)
    line = format_report(result).splitlines()
    assert "device NVIDIA H200" in line[0]
    assert line[1] == "gpu memory bandwidth: read 4000 GB/s, copy 4300 GB/s (read+write); floor uses 4300 GB/s"


def test_drive_takes_params_per_request(engine):
    probe = StepProbe(engine.runner)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 6)]
    st = drive(engine, probe, [[5, 6], [7, 8, 9]], params, "per")
    assert st.output_tokens == 9
    with pytest.raises(ValueError):
        drive(engine, probe, [[5, 6]], params, "bad")
    assert not engine.has_unfinished_requests()


def test_report_names_a_json_schema_run():
    result = _result_with(Bandwidth(10e9, 12e9, 16e9, 2, 1 << 20).to_dict())
    result["targets"] = evaluate_targets(result)
    result["settings"] = {"json_schema": None}
    assert "JSON schema" not in format_report(result)
    result["settings"] = {"json_schema": {"type": "object"}}
    assert "concurrency runs under a JSON schema" in format_report(result)
