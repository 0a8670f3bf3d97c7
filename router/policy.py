"""Picking a worker for a request: round-robin, least-load, prefix (cache- and load-aware), session.

The `prefix` policy scores every healthy candidate `w` and picks the highest score:

    hit(w)   = (pages of the prompt cached on w) * page_size / prompt tokens      in [0, 1]
    queue(w) = max(requests the router has in flight on w, running + waiting from w's /metrics)
    hot(w)   = queue(w) - min over candidates of queue > hotspot_threshold
    lora(w)  = for a request of a LoRA adapter: 0 if w runs (or queues) requests of it, 0.5 if w has a
               free adapter slot, 1 if its `max_lora` slots all run other adapters (the request would wait)
    score(w) = W_prefix * (0 if hot(w) else hit(w))
             - W_load   * queue(w) / (1 + max over candidates of queue)
             - W_kv     * kv_cache_usage(w)
             - W_lora   * lora(w)

Ties go to the shorter queue, then round-robin. The weights are `--prefix-weight`, `--load-weight`,
`--kv-weight`, `--lora-weight` and `--hotspot-threshold`; `lora` reads each worker's
`vllm:lora_requests_info`, so requests of one adapter gather where it already runs. With the defaults (1, 0.5, 0.2, 4) a worker holding the
whole prompt wins over an idle one until its queue is more than 4 longer: then the prefix is
worth less than spreading the load (the hot spot sheds it). `least-load` minimizes `queue`,
then KV usage; `session` sends every request with the same session header to the same worker
(rendezvous hashing, so only a departed worker's sessions move) and falls back to least-load
without the header.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field
from typing import Any

from router.config import RouterConfig
from router.prefix_index import PrefixIndex
from router.workers import Worker


@dataclass(frozen=True)
class RouteRequest:
    """What the policies know of a request: its prompt's page hashes and length, and its session."""

    hashes: tuple[int, ...] = ()
    num_prompt_tokens: int = 0
    session: str | None = None
    adapter: str | None = None
    """The LoRA adapter the request names (None: the base model)."""


@dataclass(frozen=True)
class Decision:
    """The pick and why: every candidate's numbers and score (recorded in the L2 trace)."""

    worker: Worker
    policy: str
    candidates: list[dict[str, Any]] = field(default_factory=list)
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        """The decision as the trace records it."""
        return {"policy": self.policy, "picked": self.worker.url, "reason": self.reason,
                "candidates": self.candidates}


class Picker:
    """Applies the configured policy to the healthy candidates."""

    def __init__(self, config: RouterConfig, index: PrefixIndex):
        self.config = config
        self.index = index
        self._rr = itertools.count()

    def pick(self, candidates: list[Worker], req: RouteRequest, policy: str | None = None) -> Decision:
        """Choose one of `candidates` (non-empty) for `req`."""
        if not candidates:
            raise ValueError("no candidates")
        policy = policy or self.config.policy
        if policy == "round-robin":
            w = candidates[next(self._rr) % len(candidates)]
            return Decision(w, policy, [self._numbers(c) for c in candidates], "next in turn")
        if policy == "session" and req.session is not None:
            w = max(candidates, key=lambda c: hashlib.sha256(f"{req.session}\n{c.url}".encode()).digest())
            return Decision(w, policy, [self._numbers(c) for c in candidates], f"session {req.session!r}")
        if policy == "prefix":
            return self._prefix(candidates, req)
        return self._least_load(candidates, "least-load" if policy != "session" else "session")

    def _numbers(self, w: Worker) -> dict[str, Any]:
        return {"url": w.url, "queue": w.queue, "in_flight": w.in_flight, "kv_usage": round(w.kv_usage, 4)}

    def _least_load(self, candidates: list[Worker], policy: str) -> Decision:
        start = next(self._rr)
        order = {c.url: (i - start) % len(candidates) for i, c in enumerate(candidates)}
        w = min(candidates, key=lambda c: (c.queue, c.kv_usage, order[c.url]))
        reason = "shortest queue" if policy == "least-load" else "no session header: shortest queue"
        return Decision(w, policy, [self._numbers(c) for c in candidates], reason)

    def _prefix(self, candidates: list[Worker], req: RouteRequest) -> Decision:
        wts = self.config.weights
        queues = [c.queue for c in candidates]
        q_min, q_max = min(queues), max(queues)
        start = next(self._rr)
        rows, best = [], None
        for i, c in enumerate(candidates):
            pages, source = self.index.match(c.url, req.hashes) if req.hashes else (0, "")
            page_size = c.page_size or self.config.page_size
            hit = min(1.0, pages * page_size / req.num_prompt_tokens) if req.num_prompt_tokens else 0.0
            hot = c.queue - q_min > wts.hotspot_threshold
            lora = _adapter_cost(c, req.adapter)
            score = (wts.prefix * (0.0 if hot else hit) - wts.load * c.queue / (1 + q_max) - wts.kv * c.kv_usage
                     - wts.lora * lora)
            row = {**self._numbers(c), "matched_pages": pages, "index": source, "hit": round(hit, 4),
                   "hot": hot, "score": round(score, 6), **({"lora": lora} if req.adapter else {})}
            rows.append(row)
            key = (score, -c.queue, -((i - start) % len(candidates)))
            if best is None or key > best[0]:
                best = (key, c, row)
        assert best is not None
        _, w, row = best
        reason = (f"{row['matched_pages']} cached pages ({row['index']} index)" if row["matched_pages"] and not row["hot"]
                  else "no usable cached prefix: load")
        return Decision(w, "prefix", rows, reason)


def _adapter_cost(w: Worker, adapter: str | None) -> float:
    """`lora(w)` of the prefix score: where a request of `adapter` would find it on `w`."""
    if adapter is None or adapter in w.running_loras or adapter in w.waiting_loras:
        return 0.0
    return 1.0 if w.max_lora and len(w.running_loras) >= w.max_lora else 0.5
