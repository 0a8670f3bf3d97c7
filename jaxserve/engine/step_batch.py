"""A scheduler plan as the runner's padded device inputs, and the runner's outputs back per request."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxserve.engine.request_state import SeqState
from jaxserve.engine.runner import MAX_STOP_IDS, DecodeState, RunnerConfig, StepOutput
from jaxserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from jaxserve.models.inputs import ModelInputs


def mixed_inputs(scheduled: Sequence[ScheduledRequest], rcfg: RunnerConfig) -> tuple[ModelInputs, int]:
    """Inputs of one mixed step (prefill chunks and decodes) padded to its token bucket, and its row count."""
    T = rcfg.token_bucket(sum(s.num_new_tokens for s in scheduled))
    S = min(T, rcfg.max_num_seqs)
    inputs = ModelInputs.build(
        [(list(s.token_ids), s.start_position, list(s.page_table)) for s in scheduled],
        rcfg.page_size, num_tokens=T, num_seqs=S, pages_per_seq=rcfg.pages_per_seq,
    )
    return inputs, S


def decode_state(scheduled: Sequence[ScheduledRequest], seqs: Sequence[SeqState], rcfg: RunnerConfig,
                 reserve_pages: Callable[[str, int], int], pages_of: Callable[[str], list[int]],
                 num_steps: int | None = None) -> DecodeState:
    """The decode loop's state for running decodes, padded to their sequence bucket.

    `reserve_pages(request_id, n)` reserves the pages of up to n more tokens and returns how many
    tokens it covered; `pages_of(request_id)` is the request's page table after that. `num_steps`
    (at most the runner's `num_scheduler_steps`, its default) caps the loop's steps."""
    S = rcfg.seq_bucket(len(scheduled))
    n = min(num_steps or rcfg.num_scheduler_steps, rcfg.num_scheduler_steps)
    tokens = np.zeros(S, np.int32)
    positions = np.zeros(S, np.int32)
    tables = np.zeros((S, rcfg.pages_per_seq), np.int32)
    max_steps = np.zeros(S, np.int32)
    stop_ids = np.full((S, MAX_STOP_IDS), -1, np.int32)
    min_left = np.zeros(S, np.int32)
    for i, (s, seq) in enumerate(zip(scheduled, seqs, strict=True)):
        steps = reserve_pages(s.request_id, n) if n > 1 else 1
        pages = pages_of(s.request_id)
        tokens[i] = s.token_ids[0]
        positions[i] = s.start_position
        tables[i, : len(pages)] = pages
        max_steps[i] = max(1, steps)
        stop_ids[i, : len(seq.stop_ids)] = seq.stop_ids
        min_left[i] = max(0, seq.params.min_tokens - len(seq.token_ids))
    return DecodeState(tokens, positions, tables, max_steps, stop_ids, min_left, np.int32(max(max_steps)))


def row(out: StepOutput, i: int, n: int) -> StepOutput:
    """Row i of a step's output as per-token arrays of length n."""
    if out.token_ids.ndim == 1:
        return StepOutput(out.token_ids[i:i + 1], out.logprobs[i:i + 1], out.ranks[i:i + 1],
                          out.top_ids[i:i + 1], out.top_logprobs[i:i + 1], np.int32(1))
    return StepOutput(out.token_ids[:n, i], out.logprobs[:n, i], out.ranks[:n, i], out.top_ids[:n, i],
                      out.top_logprobs[:n, i], np.int32(n))


def sampled_rows(plan: SchedulerOutput, kind: str, out: StepOutput) -> dict[str, StepOutput]:
    """A fetched step's outputs per request: one token per sampling row of a mixed step, or each
    row's `num_generated` tokens of a decode loop."""
    if kind == "mixed":
        return {s.request_id: row(out, i, 1) for i, s in enumerate(plan.scheduled) if s.sample}
    return {s.request_id: row(out, i, int(out.num_generated[i])) for i, s in enumerate(plan.scheduled)}


def step_shapes(plan: SchedulerOutput, rcfg: RunnerConfig, mcfg: Any) -> tuple[dict, dict]:
    """What a plan runs as, for traces: the bucket (L6) and the attention kernel's shapes (L7)."""
    if all(s.is_decode for s in plan.scheduled):
        S = rcfg.seq_bucket(len(plan.scheduled))
        bucket = {"kind": "decode", "num_seqs": S, "pages_per_seq": rcfg.pages_per_seq,
                  "num_scheduler_steps": rcfg.num_scheduler_steps}
        q_tokens = S
    else:
        T = rcfg.token_bucket(plan.num_batched_tokens)
        bucket = {"kind": "mixed", "num_tokens": T, "num_seqs": min(T, rcfg.max_num_seqs),
                  "pages_per_seq": rcfg.pages_per_seq}
        q_tokens = T
    kernel = {"backend": rcfg.backend, "q": [q_tokens, mcfg.num_heads, mcfg.head_dim],
              "kv_pages": [mcfg.num_layers, rcfg.num_pages, rcfg.page_size, mcfg.num_kv_heads, mcfg.head_dim]}
    return bucket, kernel
