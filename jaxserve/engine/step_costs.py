"""What a step costs, measured at warmup, for the drafter (`speculative.Drafter`) to weigh drafts against."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxserve.engine.warmup import inert_decode_state
from jaxserve.models.inputs import ModelInputs

if TYPE_CHECKING:
    from jaxserve.engine.draft_model import DraftModel


@dataclass(frozen=True)
class StepCosts:
    """Seconds of a step, measured at warmup (`step_costs`): a decode step by sequence bucket, and a step
    that verifies drafts by its bucket (chunked: the mixed step's tokens; as rows: the decode step's); with a
    draft model, its drafting loop by sequence bucket (every row drafting `num_speculative_tokens`)."""

    decode: Mapping[int, float]
    verify: Mapping[int, float]
    draft: Mapping[int, float] | None = None


def step_costs(runner: Any, chunked: bool, repeats: int = 2, model: DraftModel | None = None) -> StepCosts:
    """Seconds of a decode step with every row of each sequence bucket active, `chunked`, of a mixed step of
    one-token sequences in each token bucket up to the most rows a step holds, and of a draft `model`'s loop at
    each sequence bucket (the best of `repeats`, on a `ModelRunner`, into page 0): what drafts are weighed against."""
    rc = runner.cfg

    def best(run) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        return min(times)

    decode = {}
    for S in rc.seq_buckets:
        st = dataclasses.replace(inert_decode_state(runner, S), max_steps=np.ones(S, np.int32), num_steps=np.int32(1))
        decode[S] = best(lambda st=st, S=S: runner.run_decode(st, runner.inert_sampling(S), None, want_top=False))
    draft = {S: best(lambda S=S: model.time_draft(S)) for S in rc.seq_buckets} if model is not None else None
    if not chunked:
        return StepCosts(decode, decode, draft)
    mixed = {}
    for T in rc.token_buckets:
        if T > rc.token_bucket(min(rc.max_num_seqs, rc.max_num_batched_tokens)):
            break
        S = min(T, rc.max_num_seqs)
        inputs = ModelInputs.build([([0], 0, [0])] * S, rc.page_size, num_tokens=T, num_seqs=S,
                                   pages_per_seq=rc.pages_per_seq, lora_slots=[-1] * S if rc.lora else None,
                                   long_prompts=[False] * S if rc.long_rope else None, mrope=rc.mrope,
                                   state_slots=[0] * S if runner.model_cfg.mamba else None)
        mixed[T] = best(lambda i=inputs, S=S: runner.run_mixed(i, runner.inert_sampling(S), None, want_top=False))
    return StepCosts(decode, mixed, draft)
