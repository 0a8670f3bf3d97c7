"""The warmup's compiles side by side: every shape bucket's step lowered and compiled in a pool of threads before
the runner calls each once (the calls then find their executables compiled: JAX keeps them by the lowered
computation, whichever way it was compiled).

Measured on 2 cores, SmolLM2 at `jaxserve serve`'s defaults (6 mixed-step and 6 decode-loop buckets), one after
another against side by side, alternated, two rounds: compiled afresh 126.5 and 139.3 s against 86.3 and 89.0 s;
from the persistent compilation cache 27.5 and 28.3 s against 18.7 and 19.3 s (reading an executable back runs
mostly outside Python's lock). Two threads did better there than 4 or 12 (20.2, 24.3, 26.5 s from the cache, one run each)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

import jax
import numpy as np

from jaxserve.models.inputs import ModelInputs

# (a jitted step function, a function giving the arguments of its call)
Job = tuple[Any, Callable[[], tuple[Any, ...]]]


def workers(num_jobs: int) -> int:
    """Threads for `num_jobs` compiles: one a core (at least two, so that one's tracing overlaps another's
    compile), no more than the jobs; one in a cluster of processes, whose compiles of executables spanning them
    must come in the same order in each (side by side, a process's peer stopped answering)."""
    if jax.process_count() > 1:
        return 1
    return max(1, min(num_jobs, max(2, os.cpu_count() or 1)))


def compile_all(jobs: Sequence[Job], progress: bool = False, desc: str = "Compiling shape buckets") -> None:
    """Lower and compile each job's function for its arguments, several at once (`workers`); the first failure is
    raised."""

    def compile_one(job: Job) -> None:
        fn, args = job
        fn.lower(*args()).compile()

    def shown(done: Iterable[Any]) -> Iterable[Any]:
        if not progress:
            return done
        from tqdm.auto import tqdm

        return tqdm(done, total=len(jobs), desc=desc, unit="bucket", leave=False)

    n = workers(len(jobs))
    if n == 1:
        for job in shown(jobs):
            compile_one(job)
        return
    with ThreadPoolExecutor(n, thread_name_prefix="jaxserve-compile") as pool:
        for future in shown(as_completed([pool.submit(compile_one, job) for job in jobs])):
            future.result()


def inert_decode_state(runner: Any, S: int) -> Any:
    """A decode loop's state (`runner.DecodeState`) of `S` padding rows (no steps to run) for a `ModelRunner`."""
    from jaxserve.engine.runner import MAX_STOP_IDS, DecodeState

    P, cfg = runner.cfg.pages_per_seq, runner.cfg
    return DecodeState(
        tokens=np.zeros(S, np.int32), positions=np.zeros(S, np.int32), block_tables=np.zeros((S, P), np.int32),
        max_steps=np.zeros(S, np.int32), stop_ids=np.full((S, MAX_STOP_IDS), -1, np.int32),
        min_tokens_left=np.zeros(S, np.int32), num_steps=np.int32(0),
        lora_slots=np.full(S, -1, np.int32) if cfg.lora else None,
        long_prompt=np.zeros(S, np.bool_) if cfg.long_rope else None,
        rope_delta=np.zeros(S, np.int32) if cfg.mrope else None,
        state_slots=np.zeros(S, np.int32) if runner.model_cfg.mamba else None,
    )


def bucket_call(runner: Any, kind: str, size: int) -> tuple[Any, Callable[[], tuple[Any, ...]], Callable[[], Any]]:
    """A `ModelRunner`'s bucket ("mixed" or "pool" of `size` tokens, "decode" of `size` rows): its jitted step, a
    function giving the step's arguments, and a run of the step on inert inputs (one token, into the reserved
    page)."""
    if kind == "decode":
        st, sampling = inert_decode_state(runner, size), runner.inert_sampling(size)
        return (runner.steps.decode, lambda: runner.decode_args(st, sampling, None, False),
                lambda: runner.run_decode(st, sampling, None, want_top=False))
    S = min(size, runner.cfg.max_num_seqs)
    inputs = ModelInputs.build([([0], 0, [0])], runner.cfg.page_size, num_tokens=size, num_seqs=S,
                               pages_per_seq=runner.cfg.pages_per_seq, lora_slots=[-1] if runner.cfg.lora else None,
                               long_prompts=[False] if runner.cfg.long_rope else None, mrope=runner.cfg.mrope,
                               state_slots=[0] if runner.model_cfg.mamba else None)
    if kind == "pool":
        return runner.steps.pool, lambda: (runner.params, runner.kv, inputs), lambda: runner.fetch(runner.dispatch_pool(inputs))
    sampling = runner.inert_sampling(S)
    return (runner.steps.mixed, lambda: runner.mixed_args(inputs, sampling, None, False),
            lambda: runner.run_mixed(inputs, sampling, None, want_top=False))
