"""The step functions shared between runners: shared while used, a few kept after, the rest released (with
their compiled executables)."""

import gc
import weakref

import pytest

from jaxserve.engine import compiled_steps
from jaxserve.engine.runner import RunnerConfig


def _mixed(params, kv, *args, top_k, hidden, cfg, backend, model_fn):
    return params, kv


def _decode(params, kv, *args, top_k, n_max, cfg, backend, model_fn):
    return params, kv


def _model(params, x):
    return x


def _steps(max_num_seqs: int) -> compiled_steps.StepFunctions:
    cfg = RunnerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=16, max_model_len=64, page_size=16,
                       num_pages=8, num_scheduler_steps=1, backend="xla")
    return compiled_steps.step_functions(_mixed, _decode, None, "model", cfg, {}, {}, _model)


@pytest.fixture(autouse=True)
def _fresh():
    compiled_steps.clear()
    yield
    compiled_steps.clear()


def test_runners_of_one_configuration_share_their_steps():
    a = _steps(4)
    assert _steps(4) is a and _steps(8) is not a
    assert _steps(4).mixed is a.mixed


def test_released_steps_beyond_the_last_few_are_dropped():
    n = compiled_steps.KEEP_RELEASED
    refs = [weakref.ref(_steps(seqs).mixed) for seqs in range(1, n + 3)]
    gc.collect()
    assert [r() is None for r in refs] == [True, True] + [False] * n
    kept = refs[-1]()
    assert _steps(n + 2).mixed is kept, "a released configuration still kept is found again"


def test_steps_in_use_are_shared_however_many():
    n = compiled_steps.KEEP_RELEASED
    held = [_steps(seqs) for seqs in range(1, n + 4)]
    gc.collect()
    assert all(_steps(seqs) is steps for seqs, steps in zip(range(1, n + 4), held, strict=True))
    del held
    gc.collect()
    assert len(compiled_steps._live) == n, "only the last few stay once no runner holds them"


def test_mappings_are_counted_and_a_warmup_near_the_limit_warns(monkeypatch, caplog):
    counts = compiled_steps.memory_mappings()
    assert counts is not None and 0 < counts[0] < counts[1], "Linux: /proc tells both"
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine_args import EngineArgs
    from tests.fake_model import fake_loaded_model

    engine = LLMEngine(EngineArgs(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32, page_size=8,
                                  kv_cache_memory_bytes=16 * 2 * 8 * 4 * 4, num_scheduler_steps=1,
                                  compile_cache_dir=None), loaded=fake_loaded_model(), progress=False)
    with caplog.at_level("WARNING", logger="jaxserve.engine.compiled_steps"):
        engine.runner.warmup(progress=False)
        assert not caplog.records
        monkeypatch.setattr(compiled_steps, "memory_mappings", lambda: (50_000, 65_530))
        engine.runner.warmup(progress=False)
    assert len(caplog.records) == 1 and "50000 of the 65530" in caplog.text and "vm.max_map_count" in caplog.text
