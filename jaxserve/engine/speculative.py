"""Speculative decoding with n-gram drafts (prompt lookup), verified in one mixed step.

A decoding request whose last tokens already appeared earlier in its context (code being edited,
a document being quoted or summarized, a structured answer that repeats its keys) often goes on
as it went on then. Before a step, the engine looks up the request's last `n` tokens (from
`prompt_lookup_max` down to `prompt_lookup_min`) in its prompt and output, and proposes the up to
`num_speculative_tokens` tokens that followed their latest earlier occurrence as drafts.

Verification needs no change to the model. The request's last token and its drafts `d1..dm` go
into a mixed step as m + 1 rows of one token each, at consecutive positions, sharing the request's
page table. Every layer writes the step's new K/V into the pages before it attends, so the row at
position p attends over positions 0..p, the drafts before it included: the same computation as one
causal chunk. Each row is sampled as an ordinary decode at its output index (its seed stream, its
penalty history with the drafts before it, its min_tokens), giving t0..tm. The tokens taken are
t0, t1, ... while each t_i equals the draft d_{i+1} it was checked against; the first mismatch (or
tm, when every draft held) is the last token taken. A draft is taken exactly when the model would
have sampled it, so the output equals decoding without speculation, greedy or seeded: the same
tokens, fewer steps. The KV of the taken tokens is already in the pages; a rejected draft's KV lies
past the request's computed length and is overwritten by later steps.

Requests under structured outputs are not drafted (the grammar's mask for each position depends
on the token before it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from jaxserve.engine.request import Request
from jaxserve.engine.runner import StepOutput
from jaxserve.engine.scheduler_output import ScheduledRequest
from jaxserve.engine_args import SpeculativeConfig


def propose_ngram(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> np.ndarray:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix of `tokens`
    (of `n_max` down to `n_min` tokens) found earlier in it; empty when none is."""
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        # Windows starting at 0 .. L-1-n: every occurrence but the suffix itself.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:L - 1], n)
        hits = np.flatnonzero((windows == tokens[L - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k]
    return tokens[:0]


MAX_BACKOFF = 16


@dataclass
class DraftBackoff:
    """A completion's drafting pace: after a step that accepted none of its drafts it skips the next
    `wait` steps, 1, 2, 4 ... up to MAX_BACKOFF in a row, until drafts are accepted again. Text the
    context does not predict (sampling at a high temperature, new prose) then costs few wasted rows."""

    wait: int = 0
    backoff: int = 0

    def ready(self) -> bool:
        if self.wait > 0:
            self.wait -= 1
            return False
        return True

    def record(self, accepted: int) -> None:
        self.backoff = 0 if accepted else min(2 * self.backoff or 1, MAX_BACKOFF)
        self.wait = self.backoff


def drafts_for(request: Request, pace: DraftBackoff, k: int, cfg: SpeculativeConfig,
               reserve: Callable[[str, int], int]) -> list[int]:
    """A decoding request's drafts (at most k), from its prompt and output, with the pages of its
    last token and drafts reserved (`reserve(request_id, n)` covers up to n tokens, as
    `Scheduler.reserve_decode_pages`: fewer near max_tokens or when pages are short)."""
    if not pace.ready():
        return []
    tokens = np.asarray(request.all_token_ids, np.int32)
    d = propose_ngram(tokens, min(k, cfg.num_speculative_tokens), cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    return d[:reserve(request.request_id, 1 + len(d)) - 1].tolist() if d.size else []


@dataclass
class SpecCounters:
    """Totals for metrics, named as vLLM's `spec_decode_*` counters."""

    spec_num_drafts: int = 0  # requests drafted, summed over steps
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0


@dataclass
class SpecStep:
    """A mixed step that verifies drafts: its rows (each request's scheduled row, a drafted decode
    followed by one row per draft) and each drafted request's drafts."""

    rows: list[ScheduledRequest]
    drafts: dict[str, list[int]]
    counters: SpecCounters = field(default_factory=SpecCounters)
    paces: dict[str, DraftBackoff] = field(default_factory=dict)  # of the drafted requests

    def verify(self, out: StepOutput) -> dict[str, StepOutput]:
        """Each sampling request's tokens: one per undrafted request, the accepted run per drafted one.
        `out` has a token per row: a mixed step's, or the first (only) step of a decode loop's."""
        if out.token_ids.ndim == 2:
            out = StepOutput(out.token_ids[0], out.logprobs[0], out.ranks[0], out.top_ids[0], out.top_logprobs[0],
                             out.num_generated)
        got: dict[str, StepOutput] = {}
        i = 0
        while i < len(self.rows):
            s = self.rows[i]
            d = self.drafts.get(s.request_id, ())
            if s.sample:
                n = 1
                while n <= len(d) and int(out.token_ids[i + n - 1]) == d[n - 1]:
                    n += 1
                self.counters.spec_num_accepted_tokens += n - 1
                if d:
                    self.paces[s.request_id].record(n - 1)
                got[s.request_id] = StepOutput(out.token_ids[i:i + n], out.logprobs[i:i + n], out.ranks[i:i + n],
                                               out.top_ids[i:i + n], out.top_logprobs[i:i + n], np.int32(n))
            i += 1 + len(d)
        return got


def draft_rows(scheduled: Sequence[ScheduledRequest], propose: Callable[[ScheduledRequest, int], list[int]],
               budget: int, free_rows: int, pages_of: Callable[[str], list[int]],
               counters: SpecCounters, paces: Mapping[str, DraftBackoff]) -> SpecStep | None:
    """The step's rows with drafts for its decodes, or None when no decode gets any.

    `propose(s, k)` drafts up to k tokens for decode `s` (reserving their pages; it may give fewer);
    `budget` and `free_rows` are the tokens and sequence rows the step has left; `paces` the
    requests' drafting paces."""
    rows: list[ScheduledRequest] = []
    drafts: dict[str, list[int]] = {}
    for s in scheduled:
        d = propose(s, min(budget, free_rows)) if s.is_decode and budget > 0 and free_rows > 0 else []
        if not d:
            rows.append(s)
            continue
        budget -= len(d)
        free_rows -= len(d)
        drafts[s.request_id] = d
        pages = tuple(pages_of(s.request_id))
        pos = s.start_position
        rows.append(ScheduledRequest(s.request_id, 1, pos, s.token_ids, pages, True, True))
        rows.extend(ScheduledRequest(s.request_id, 1, pos + 1 + j, (t,), pages, True, True) for j, t in enumerate(d))
    if not drafts:
        return None
    counters.spec_num_drafts += len(drafts)
    counters.spec_num_draft_tokens += sum(len(d) for d in drafts.values())
    return SpecStep(rows, drafts, counters, {rid: paces[rid] for rid in drafts})


def row_outputs(step: SpecStep, token_ids: Mapping[str, list[int]]) -> list[list[int]]:
    """Each row's output tokens so far: a draft row's request's outputs plus the drafts before it
    (what its sampling and penalties see)."""
    out, i = [], 0
    while i < len(step.rows):
        rid = step.rows[i].request_id
        d = step.drafts.get(rid, [])
        base = token_ids[rid]
        out.append(base)
        out.extend(base + d[:j + 1] for j in range(len(d)))
        i += 1 + len(d)
    return out
