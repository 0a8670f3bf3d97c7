"""Speculative decoding with n-gram drafts (prompt lookup) or a draft model's, verified in one step.

With a draft model (`SpeculativeConfig.model`), `draft_model.DraftModel` writes the drafts instead of the
lookup below (an MTP layer or EAGLE head likewise: `mtp`, `eagle`), and with method "suffix",
`suffix_decoding.SuffixDecoding`; how they are chosen, verified and taken is the same.

A decoding request whose last tokens already appeared earlier in its context (code being edited,
a document being quoted or summarized, a structured answer that repeats its keys) often goes on
as it went on then. Before a step, the engine looks up the request's last `n` tokens (from
`prompt_lookup_max` down to `prompt_lookup_min`) in its prompt and output, and proposes the up to
`num_speculative_tokens` tokens that followed their latest earlier occurrence as drafts.

Verification needs no change to the model. The request's last token and its drafts `d1..dm` are
m + 1 rows of the step (`draft_rows`) at consecutive positions, sharing the request's page table, in
one of two forms (`SpeculativeConfig.draft_verification`):
- "rows" (the default): m + 1 sequences of one token each, in the decode step (or beside a prefill
  chunk, in the mixed step). Every layer writes the step's new K/V into the pages before it attends,
  so each row reads the drafts before it; each row reads the request's KV pages, and the decode
  kernels split a long context across the GPU. On the CPU this form's step is 7-9% cheaper (an 8-row
  step, one request with 4 drafts beside 3 decodes, SmolLM2, at 300 to 3,000 tokens of context).
- "chunks": a mixed step runs them as one sequence of m + 1 query tokens, causal, with logits at each
  (`step_batch.mixed_inputs`), so the request's KV pages are read once for all m + 1 rows, as a
  prefill chunk's are (by the prefill kernels, which the Mosaic GPU one does without splits).
Either way the row at position p attends over positions 0..p, the drafts before it included. Each
row is sampled as an ordinary decode at its output index (its seed stream, its penalty history with
the drafts before it, its min_tokens), giving t0..tm. The tokens taken are
t0, t1, ... while each t_i equals the draft d_{i+1} it was checked against; the first mismatch (or
tm, when every draft held) is the last token taken. A draft is taken exactly when the model would
have sampled it, so the output equals decoding without speculation, greedy or seeded: the same
tokens, fewer steps. The KV of the taken tokens is already in the pages; a rejected draft's KV lies
past the request's computed length and is overwritten by later steps.

How many drafts a step verifies is the `Drafter`'s choice: the most expected tokens per second of
step, from the measured cost of each step bucket (`StepCosts`) and the running acceptance rate. A completion
whose drafts were all rejected waits a few steps before it is drafted again (`DraftBackoff`).

Under structured outputs, drafts are cut at the first token the grammar refuses, and each draft
row is sampled under the grammar's mask after the drafts before it (`GrammarMatcher.fill_bitmasks`),
so a taken token is one the grammar allowed there, as without drafts.

The lookup is incremental (`NgramIndex`, kept on the request): each n-gram's 32-bit hash is computed
once, as its last token arrives, so a step compares one integer per earlier position (vectorized) and
converts no token list; a hash match is confirmed on the tokens themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from jaxserve.engine.request import Request
from jaxserve.engine.runner import RunnerConfig, StepOutput
from jaxserve.engine.scheduler_output import ScheduledRequest
from jaxserve.engine.step_costs import StepCosts
from jaxserve.engine.suffix_decoding import SuffixDecoding, prediction_drafts
from jaxserve.speculative_config import SpeculativeConfig

if TYPE_CHECKING:
    from jaxserve.engine.draft_model import DraftModel

PROBE_EVERY = 64  # decode steps in a row whose drafts the costs turn down, then one verifies drafts anyway


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


_HASH_MUL = np.uint32(0x9E3779B1)


class NgramIndex:
    """A request's tokens and the hash of every n-gram in them, n from `n_min` to `n_max`, grown as the
    tokens arrive. `propose` returns what `propose_ngram` would, in time linear in the context with
    one integer compared per position, and `extend` does work only for the new tokens."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.size = 0
        self.tokens = np.empty(64, np.int32)
        # 32-bit hashes (a match is confirmed on the tokens): 4 + 4 * (n_max - n_min + 1) bytes a token.
        self.codes = {n: np.empty(64, np.uint32) for n in range(n_min, n_max + 1)}  # by window start

    def extend(self, new: Sequence[int]) -> None:
        """Append tokens and hash the windows they complete."""
        old, m = self.size, len(new)
        if m == 0:
            return
        if old + m > len(self.tokens):
            cap = max(2 * len(self.tokens), old + m)
            self.tokens = np.resize(self.tokens, cap)
            self.codes = {n: np.resize(c, cap) for n, c in self.codes.items()}
        self.tokens[old:old + m] = new
        self.size = old + m
        for n, codes in self.codes.items():
            lo, hi = max(old - n + 1, 0), self.size - n + 1  # starts of the windows ending in the new tokens
            if hi > lo:
                windows = np.lib.stride_tricks.sliding_window_view(self.tokens[lo:self.size], n).astype(np.uint32)
                h = np.zeros(hi - lo, np.uint32)
                for j in range(n):
                    h = h * _HASH_MUL + windows[:, j] + np.uint32(1)
                codes[lo:hi] = h

    def sync(self, request: Request) -> NgramIndex:
        """Take the request's tokens that arrived since the last call (its tokens only ever grow)."""
        if request.num_tokens > self.size:
            self.extend(request.token_ids_in(self.size, request.num_tokens))
        return self

    def propose(self, k: int) -> np.ndarray:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix found
        earlier (as `propose_ngram`); empty when none is."""
        L, t = self.size, self.tokens
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            codes = self.codes[n]
            suffix = t[L - n:L]
            for start in np.flatnonzero(codes[:L - n] == codes[L - n])[::-1]:
                if np.array_equal(t[start:start + n], suffix):  # not a hash collision
                    draft = t[start + n:min(start + n + k, L)].astype(np.int32)
                    images = np.flatnonzero(draft < 0)  # an image's cache ids (`multimodal`) are no tokens
                    return draft[:images[0]] if images.size else draft
        return np.empty(0, np.int32)


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


@dataclass
class SpecCounters:
    """Totals for metrics, named as vLLM's `spec_decode_*` counters."""

    spec_num_drafts: int = 0  # requests drafted, summed over steps
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # by draft position: the first, ...


class AcceptanceRate:
    """The chance that a draft is accepted when the drafts before it were: drafts accepted over drafts
    checked (a draft is checked when those before it were accepted), older steps weighing less."""

    def __init__(self, prior: float = 0.5, weight: float = 4.0, decay: float = 0.98):
        self.hits, self.tries, self.decay = prior * weight, weight, decay

    def record(self, num_drafts: int, accepted: int) -> None:
        checked = accepted + (accepted < num_drafts)
        self.hits = self.hits * self.decay + accepted
        self.tries = self.tries * self.decay + checked

    @property
    def p(self) -> float:
        return self.hits / self.tries


@dataclass
class SpecStep:
    """A step that verifies drafts: its rows (each request's scheduled row, a drafted decode followed
    by one row per draft) and each drafted request's drafts."""

    rows: list[ScheduledRequest]
    drafts: dict[str, list[int]]
    drafter: Drafter
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
                if d:
                    self.drafter.record(len(d), n - 1)
                    self.paces[s.request_id].record(n - 1)
                    if (req := self.drafter.predicted.get(s.request_id)) is not None:
                        req.prediction_accepted += n - 1
                got[s.request_id] = StepOutput(out.token_ids[i:i + n], out.logprobs[i:i + n], out.ranks[i:i + n],
                                               out.top_ids[i:i + n], out.top_logprobs[i:i + n], np.int32(n))
            i += 1 + len(d)
        return got


class Drafter:
    """Proposes a step's drafts and decides how many of them to verify.

    Without drafts, a decode-only step runs in the decode executable of its sequence bucket; with them,
    `chunked`, in the mixed step of the token bucket that holds its rows (each drafted request one
    sequence of its token and drafts), else in the decode step of the sequence bucket that holds them. A
    bigger bucket costs more (`StepCosts`). The drafter verifies the number of drafts
    that gives the most expected tokens per second: the requests' first drafts before any second ones,
    the j-th worth p**j tokens (p: `AcceptanceRate`). Small batches, bound by reading the weights, verify
    drafts almost for free; large ones, bound by compute, verify few or none. A step with a prefill chunk
    verifies drafts only in the padding of its token bucket. Without costs (no warmup), every proposed
    draft within the step's room is verified. After PROBE_EVERY decode steps in a row whose drafts the costs turned
    down, one step verifies drafts anyway (`_probe`): drafts that are accepted raise the rate until they pay.
    """

    def __init__(self, cfg: SpeculativeConfig, costs: StepCosts | None = None, model: DraftModel | None = None):
        self.cfg = cfg
        self.costs = costs
        self.model = model  # a draft model writes the drafts (None: n-gram lookup, or suffix decoding's)
        self.suffix = SuffixDecoding(cfg.suffix_decoding_max_tree_depth, cfg.suffix_decoding_max_cached_requests,
                                     cfg.suffix_decoding_max_spec_factor, cfg.suffix_decoding_min_token_prob) \
            if cfg.method == "suffix" else None
        self.chunked = cfg.chunked
        self.counters = SpecCounters()
        self.rate = AcceptanceRate()
        self.declined = 0  # decode steps in a row whose drafts the costs turned down
        self.predicted: dict[str, Request] = {}  # this step's requests drafted from their predicted outputs

    def _probe(self) -> bool:
        """Whether this step, whose drafts the costs turn down, verifies some anyway (one a request; a draft model's
        whose loop, then run, is paid: those that pay given it): one such step in PROBE_EVERY, so that the acceptance
        rate is still learned when the rate so far says drafts do not pay."""
        self.declined += 1
        if self.declined < PROBE_EVERY:
            return False
        self.declined = 0
        return True

    def finished(self, request: Request) -> None:
        """A request finished (suffix decoding caches its response)."""
        if self.suffix is not None:
            self.suffix.finished(request)

    def record(self, num_drafts: int, accepted: int) -> None:
        c = self.counters
        c.spec_num_accepted_tokens += accepted
        c.spec_num_accepted_tokens_per_pos.extend([0] * (accepted - len(c.spec_num_accepted_tokens_per_pos)))
        for i in range(accepted):
            c.spec_num_accepted_tokens_per_pos[i] += 1
        self.rate.record(num_drafts, accepted)

    def propose(self, ready: Sequence[ScheduledRequest], request_of: Callable[[str], Request],
                reserve: Callable[[str, int], int], pages_of: Callable[[str], list[int]]) -> dict[str, np.ndarray]:
        """Up to `num_speculative_tokens` drafts for each of the `ready` decodes: from the draft model (the pages of
        the drafted positions reserved first: it writes its KV there), else looked up in the request's context."""
        cfg, k = self.cfg, self.cfg.num_speculative_tokens
        if self.model is not None:
            rows = []
            for s in ready:
                n = reserve(s.request_id, 1 + k) - 1
                rows.append((s.request_id, s.token_ids[0], s.start_position, pages_of(s.request_id), n))
            return self.model.propose(rows)
        proposals = {}
        self.predicted = {}
        for s in ready:
            req = request_of(s.request_id)
            if self.suffix is None and req.ngram_index is None:
                req.ngram_index = NgramIndex(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
            own = self.suffix.propose(req, k) if self.suffix is not None else req.ngram_index.sync(req).propose(k)
            predicted = prediction_drafts(req, k)  # (a predicted output's, when at least as long)
            if predicted.size and predicted.size >= own.size:
                own, self.predicted[s.request_id] = predicted, req
            proposals[s.request_id] = own
        return proposals

    def choose(self, n: int, lengths: Mapping[str, int], room: int, decode_only: bool,
               seq_bucket: Callable[[int], int], verify_bucket: Callable[[int], int],
               drafting: float = 0.0) -> dict[str, int]:
        """How many drafts each request verifies, of the `lengths` proposed, in a step of `n` rows with
        `room` rows to spare; `drafting`: seconds the drafts cost besides their verification."""
        order = sorted(((j, rid) for rid, k in lengths.items() for j in range(1, k + 1)), key=lambda x: x[0])
        order = order[:max(0, room)]
        if decode_only and self.costs:
            p, gain, best_d = self.rate.p, 0.0, 0
            best = n / self.costs.decode[seq_bucket(n)]
            for d, (j, _) in enumerate(order, 1):
                gain += p ** j
                score = (n + gain) / (self.costs.verify[verify_bucket(n + d)] + drafting)
                if score > best:
                    best, best_d = score, d
            order = order[:best_d]
        counts: dict[str, int] = {}
        for _, rid in order:
            counts[rid] = counts.get(rid, 0) + 1
        return counts

    def plan(self, scheduled: Sequence[ScheduledRequest], num_batched_tokens: int, rc: RunnerConfig, *,
             request_of: Callable[[str], Request], pace_of: Callable[[str], DraftBackoff | None],
             reserve: Callable[[str, int], int], pages_of: Callable[[str], list[int]],
             valid: Callable[[str, list[int]], int] | None = None) -> SpecStep | None:
        """The drafts of a step of `scheduled` rows (`num_batched_tokens` tokens), with their pages reserved, or
        None when it verifies none. They fit the rows the step can add: for decodes alone, up to the most rows
        its verifying step holds; beside a prefill chunk, the padding of its token bucket.

        `pace_of(request_id)` is None for a request that is not drafted; `valid(request_id, drafts)`
        is how many of the drafts its grammar takes; `reserve(request_id, n)` covers up to n tokens
        (as `Scheduler.reserve_decode_pages`)."""
        n, T = len(scheduled), rc.token_bucket(num_batched_tokens)
        decode_only = all(s.is_decode for s in scheduled)
        if self.chunked:
            most, verify_bucket = min(rc.max_num_seqs, rc.max_num_batched_tokens), rc.token_bucket
        else:
            most, verify_bucket = rc.max_num_seqs, rc.seq_bucket
        room = most - n if decode_only else min(T - num_batched_tokens, min(T, rc.max_num_seqs) - n)
        ready = [s for s in scheduled if s.is_decode and (pace := pace_of(s.request_id)) is not None and pace.ready()]
        probe = None  # whether a step the costs turn drafts down in verifies some anyway (decided once a step)
        if room > 0 and decode_only and self.costs and self.costs.draft and ready:
            # A draft model's loop is paid before its drafts are seen: draft only when drafts could pay for it.
            k, drafting = self.cfg.num_speculative_tokens, self.costs.draft[rc.seq_bucket(len(ready))]
            if not self.choose(n, {s.request_id: k for s in ready}, room, True, rc.seq_bucket, verify_bucket,
                               drafting):
                probe = self._probe()
                ready = ready if probe else []
        proposals = self.propose(ready, request_of, reserve, pages_of) if room > 0 and ready else {}
        if valid is not None:
            proposals = {rid: d[:valid(rid, d.tolist())] for rid, d in proposals.items()}
        proposals = {rid: d for rid, d in proposals.items() if d.size}
        counts = self.choose(n, {rid: len(d) for rid, d in proposals.items()}, room, decode_only, rc.seq_bucket,
                             verify_bucket)
        if not counts and proposals and decode_only and self.costs:
            probe = self._probe() if probe is None else probe
            if probe:  # one draft a request, within the room
                counts = {rid: 1 for rid in list(proposals)[:room]}
        elif counts:
            self.declined = 0
        drafts = {}
        for rid, k in counts.items():
            k = min(k, reserve(rid, 1 + k) - 1)
            if k > 0:
                drafts[rid] = proposals[rid][:k].tolist()
        if not drafts:
            return None
        return draft_rows(scheduled, drafts, pages_of, self, {rid: pace_of(rid) for rid in drafts})


def draft_rows(scheduled: Sequence[ScheduledRequest], drafts: Mapping[str, list[int]],
               pages_of: Callable[[str], list[int]], drafter: Drafter,
               paces: Mapping[str, DraftBackoff]) -> SpecStep:
    """The step's rows: each drafted decode as its row and one row per draft, at the next positions,
    on the request's page table after its pages were reserved (`pages_of`)."""
    rows: list[ScheduledRequest] = []
    for s in scheduled:
        d = drafts.get(s.request_id)
        if not d:
            rows.append(s)
            continue
        pages = tuple(pages_of(s.request_id))
        pos = s.start_position
        rows.append(ScheduledRequest(s.request_id, 1, pos, s.token_ids, pages, True, True))
        rows.extend(ScheduledRequest(s.request_id, 1, pos + 1 + j, (t,), pages, True, True) for j, t in enumerate(d))
    drafter.counters.spec_num_drafts += len(drafts)
    drafter.counters.spec_num_draft_tokens += sum(len(d) for d in drafts.values())
    return SpecStep(rows, dict(drafts), drafter, dict(paces))


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
