"""The scheduling decision as a pure function: ``schedule(state, config) -> (state, plan)``.

The planner sees a frozen snapshot of the scheduler (request views, page
counts) and returns what the next step runs and which page actions make that
possible. It touches no pool, no cache and no clock: the same inputs give equal
outputs. ``Scheduler`` takes the snapshot, applies the plan to the page pool and
the prefix cache, and turns it into a ``SchedulerOutput``.
"""

from __future__ import annotations

import bisect
import collections
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal, NamedTuple

from jaxserve.engine.page_pool import pages_needed
from jaxserve.engine.scheduler_config import SchedulerConfig


class RequestView(NamedTuple):
    """What the planner knows of one request: its order, token counts and pages.

    A named tuple rather than a frozen dataclass: one is built per request per
    step, and a named tuple is several times cheaper to build.
    """

    request_id: str
    priority: int
    arrival_index: int
    num_tokens: int
    """Prompt plus generated tokens."""
    num_output_tokens: int = 0
    num_computed_tokens: int = 0
    """Tokens whose KV is in the request's pages (0 while waiting)."""
    num_pages: int = 0
    """Pages in the request's page table (0 while waiting)."""
    prefix_pages: tuple[int, ...] | None = ()
    """Running: the leading pages of its page table that it holds through the prefix cache (others may
    hold them too); its other pages are its alone. Waiting: the pages of its longest cached prefix of
    all but its last token, or None when not looked up yet."""
    adapter: str | None = None
    """The LoRA adapter its tokens run with (None: the base model)."""
    whole_spans: tuple[tuple[int, int], ...] = ()
    """Positions [start, end) no chunk ends inside (`Request.whole_spans`)."""
    stops: tuple[int, ...] = ()
    """Positions a chunk that reaches past them ends at (`Request.state_stop`)."""

    @property
    def is_decoding(self) -> bool:
        """Whether the next step feeds just the last sampled token."""
        return self.num_output_tokens > 0 and self.num_computed_tokens == self.num_tokens - 1


@dataclass(frozen=True)
class SchedulerState:
    """A snapshot of the scheduler's host state between steps."""

    step: int
    running: tuple[RequestView, ...]
    """Admitted requests, in admission order."""
    waiting: tuple[RequestView, ...]
    """Waiting and preempted requests in policy order: the whole queue, or a head of it at least
    ``max_num_seqs - len(running)`` long (no step admits more), to which base-model requests further
    back may be added (admitted past requests passed over for their LoRA adapter)."""
    num_free_pages: int
    """Pages an allocation can get now: free ones plus those only the prefix cache holds."""
    pinned_pages: frozenset[int] = frozenset()
    """Cached pages held by something besides the running requests (e.g. a KV transfer): never freed by
    a preemption, and free to share."""
    finished_ids: tuple[str, ...] = ()
    """Requests finished or aborted since the previous step."""

    def __post_init__(self) -> None:
        if self.num_free_pages < 0:
            raise ValueError(f"num_free_pages must be >= 0, got {self.num_free_pages}")


PageActionKind = Literal["preempt", "grow", "admit"]


@dataclass(frozen=True)
class PageAction:
    """One change to page ownership, applied in plan order.

    ``preempt``: release all of the request's pages and send it back to waiting.
    ``grow``: append ``num_pages`` new pages to a running request's page table.
    ``admit``: take the request's cached prefix (``num_cached_tokens``) plus ``num_pages`` new pages.
    """

    kind: PageActionKind
    request_id: str
    num_pages: int = 0
    num_cached_tokens: int = 0


class PlannedRequest(NamedTuple):
    """One request's share of the step: ``num_new_tokens`` tokens from ``start_position``."""

    request_id: str
    num_new_tokens: int
    start_position: int
    sample: bool
    """True when the step feeds the request's last known token, so its logits are sampled."""
    is_decode: bool


@dataclass(frozen=True)
class SchedulePlan:
    """The decision for one step; ``scheduled`` lists decodes first, then prefill chunks."""

    step: int
    scheduled: tuple[PlannedRequest, ...]
    actions: tuple[PageAction, ...]
    """Page changes, in the order they must be applied (each fits once those before it are applied)."""
    finished_ids: tuple[str, ...] = ()
    lookup_id: str | None = None
    """A waiting request that admission reached before its cached prefix was looked up: admission stops
    there, and the caller looks the prefix up and plans again."""

    @property
    def preempted_ids(self) -> tuple[str, ...]:
        """Requests preempted in this step, in order."""
        return tuple(a.request_id for a in self.actions if a.kind == "preempt")

    @property
    def num_batched_tokens(self) -> int:
        """Tokens fed in this step."""
        return sum(s.num_new_tokens for s in self.scheduled)


def schedule(state: SchedulerState, config: SchedulerConfig) -> tuple[SchedulerState, SchedulePlan]:
    """Plan the next step from ``state``; return the state after the plan and the plan.

    Policy:
      1. Running requests, decodes first then unfinished prefills, each in
         policy order: one token per decode, a chunk of at most
         ``prefill_chunk_size`` tokens per prefill, within the token budget.
         A request that needs more pages than are free preempts the least
         important running request (under ``"priority"`` the largest priority
         value, then the newest; under ``"fcfs"`` the newest), possibly itself,
         possibly one scheduled earlier in the step (which gives its tokens
         back), until its pages fit. A preempted request goes back to waiting in
         policy order, with nothing computed.
      2. If nothing was preempted, waiting requests in policy order while the
         budget and ``max_num_seqs`` allow: each reuses its cached prefix and
         needs pages for its first chunk. Admission stops at the first request
         that does not fit (no skipping, so no starvation) and never preempts.
         One exception: a request whose LoRA adapter would be one more than
         ``max_loras`` among the running is passed over, and behind it only
         base-model requests are admitted, so its adapter gets a slot as soon
         as the running requests of another adapter end.

    The returned state has the step's page actions applied (new pages
    counted, not named) and its tokens not yet computed; its waiting
    requests need their prefixes looked up again.
    """
    planner = Planner(state, config)
    planner.advance()
    return planner.result()


class Planner:
    """One step of ``schedule``, resumable where admission needs a prefix lookup.

    ``schedule`` runs it once. ``Scheduler`` drives it instead: it applies
    ``actions`` as they grow and answers each lookup after applying the
    actions before it, as a request's cached prefix depends on what those
    allocations evicted. The planner reads only its inputs.
    """

    def __init__(self, state: SchedulerState, config: SchedulerConfig) -> None:
        self._state = state
        self._config = config
        self._key = _order_key(config)
        self._running = {v.request_id: v for v in state.running}  # insertion order is admission order
        if len(self._running) != len(state.running):
            raise ValueError("a request is listed twice among the running")
        self._num_pages = {rid: v.num_pages for rid, v in self._running.items()}
        self._pinned = set(state.pinned_pages)
        self._available = state.num_free_pages
        self._budget = config.max_num_batched_tokens
        # Running requests holding each shared page (a page is freed when its last holder goes);
        # counted only when a step preempts or shares a cached prefix.
        self._holders: collections.Counter[int] | None = None
        self._num_new: dict[str, int] = {}  # insertion order is the output order
        self._decode_ids: set[str] = set()
        self._preempted: list[RequestView] = []
        self._waiting = list(state.waiting)
        self._next = 0  # the next waiting request admission looks at; those before it were passed over
        self._adapters = collections.Counter(v.adapter for v in state.running if v.adapter is not None)
        self._lookup_id: str | None = None
        self.actions: list[PageAction] = []
        """Page actions so far, in the order they must be applied."""
        self._plan_running()

    def _held(self) -> collections.Counter[int]:
        if self._holders is None:
            self._holders = collections.Counter(p for v in self._running.values() for p in v.prefix_pages)
        return self._holders

    def _plan_running(self) -> None:
        ps, chunk, key = self._config.page_size, self._config.prefill_chunk_size, self._key
        running, num_pages, num_new = self._running, self._num_pages, self._num_new
        decodes, prefills = [], []
        for v in self._state.running:
            (decodes if v.is_decoding else prefills).append(v)
        decodes.sort(key=key)
        prefills.sort(key=key)
        self._decode_ids = {v.request_id for v in decodes}
        # The first prefill stands at (or in) an image whose tokens a chunk must hold whole: when they fit the
        # step's budget but not beside the decodes, the last decodes give way for this step (else the image could
        # wait as long as decodes keep coming).
        reserve = 0
        if prefills:
            head, start = prefills[0], prefills[0].num_computed_tokens
            rest = next((end - start for first, end in head.whole_spans if first <= start < end), 0)
            if rest and rest <= self._budget and _chunk(head, start, chunk, self._budget - len(decodes)) == 0:
                reserve = rest if _chunk(head, start, chunk, rest) == rest else 0
        for view in decodes + prefills:
            rid = view.request_id
            if rid not in running:
                continue  # preempted earlier in this loop
            if self._budget == 0:
                break
            if rid in self._decode_ids and self._budget <= reserve:
                continue  # giving way to the image's chunk
            while True:
                n = _chunk(view, view.num_computed_tokens, chunk, self._budget)
                need = pages_needed(view.num_computed_tokens + n, ps) - num_pages[rid]
                if need <= self._available:
                    break
                victim = max(running.values(), key=key)
                holders = self._held()
                del running[victim.request_id]
                # A victim scheduled earlier in this loop gives its tokens back.
                self._budget += num_new.pop(victim.request_id, 0)
                self._available += num_pages[victim.request_id] - len(victim.prefix_pages)
                for page in victim.prefix_pages:
                    holders[page] -= 1
                    if holders[page] == 0 and page not in self._pinned:
                        self._available += 1
                self.actions.append(PageAction("preempt", victim.request_id))
                self._preempted.append(victim)
                if victim.request_id == rid:
                    break
            if rid not in running or n == 0:  # n == 0: a span that does not fit this step's budget
                continue
            if need > 0:
                self._available -= need
                num_pages[rid] += need
                self.actions.append(PageAction("grow", rid, num_pages=need))
            num_new[rid] = n
            self._budget -= n

    def advance(self) -> str | None:
        """Admit waiting requests; returns the id of one whose prefix must be looked up first, or None when done."""
        ps, chunk, waiting = self._config.page_size, self._config.prefill_chunk_size, self._waiting
        self._lookup_id = None
        # Preemption means memory is short: admitting now would only thrash.
        while (
            not self._preempted
            and self._next < len(waiting)
            and self._budget > 0
            and len(self._running) < self._config.max_num_seqs
        ):
            view = waiting[self._next]
            # Behind a request passed over for its adapter, only base-model requests are admitted.
            if view.adapter is not None and (self._next or not self._adapter_fits(view.adapter)):
                self._next += 1
                continue
            prefix = view.prefix_pages
            if prefix is None:
                self._lookup_id = view.request_id
                break
            num_cached = len(prefix) * ps
            if num_cached >= view.num_tokens:
                raise ValueError(f"{view.request_id!r}: a cached prefix must leave a token to compute")
            n = _chunk(view, num_cached, chunk, self._budget)
            if n == 0:
                break
            need = pages_needed(num_cached + n, ps) - len(prefix)
            lock_cost = 0
            if prefix:
                holders = self._held()
                # Sharing a page only the cache held makes it unevictable, so it costs one free page.
                lock_cost = sum(1 for p in prefix if holders[p] == 0 and p not in self._pinned)
            if need + lock_cost > self._available:
                break
            if prefix:
                holders.update(prefix)
            self._available -= need + lock_cost
            waiting.pop(self._next)
            if view.adapter is not None:
                self._adapters[view.adapter] += 1
            view = _with(view, num_cached, len(prefix) + need, prefix)
            self._running[view.request_id] = view
            self._num_pages[view.request_id] = view.num_pages
            self.actions.append(
                PageAction("admit", view.request_id, num_pages=need, num_cached_tokens=num_cached)
            )
            self._num_new[view.request_id] = n
            self._budget -= n
        return self._lookup_id

    def provide_prefix(
        self, request_id: str, prefix_pages: tuple[int, ...], locked_pages: Iterable[int]
    ) -> None:
        """Answer a lookup: the request's cached prefix, and which of its pages are in locked cache nodes."""
        if self._lookup_id != request_id:
            raise ValueError(f"no lookup of {request_id!r} is pending")
        holders = self._held()
        # A locked page no running request holds is locked by someone else: pinned.
        self._pinned.update(p for p in locked_pages if holders[p] == 0)
        self._waiting[self._next] = _with(self._waiting[self._next], 0, 0, tuple(prefix_pages))
        self._lookup_id = None

    def _adapter_fits(self, adapter: str) -> bool:
        """Whether a request of `adapter` may run: its adapter is running, or another one fits `max_loras`."""
        limit = self._config.max_loras
        return limit is None or adapter in self._adapters or len(self._adapters) < limit

    def result(self) -> tuple[SchedulerState, SchedulePlan]:
        """The state after the plan, and the plan (see ``schedule``)."""
        running, num_pages = self._running, self._num_pages
        scheduled = []
        for rid, n in self._num_new.items():
            view = running[rid]
            start = view.num_computed_tokens
            scheduled.append(
                PlannedRequest(rid, n, start, start + n == view.num_tokens, rid in self._decode_ids)
            )
        plan = SchedulePlan(
            step=self._state.step,
            scheduled=tuple(scheduled),
            actions=tuple(self.actions),
            finished_ids=self._state.finished_ids,
            lookup_id=self._lookup_id,
        )
        waiting = list(self._waiting)
        for view in self._preempted:
            bisect.insort(waiting, _with(view, 0, 0, None), key=self._key)
        new_state = SchedulerState(
            step=self._state.step + 1,
            running=tuple(
                v
                if v.num_pages == num_pages[rid]
                else _with(v, v.num_computed_tokens, num_pages[rid], v.prefix_pages)
                for rid, v in running.items()
            ),
            waiting=tuple(v if v.prefix_pages is None else _with(v, 0, 0, None) for v in waiting),
            num_free_pages=self._available,
            pinned_pages=frozenset(self._pinned),
            finished_ids=(),
        )
        return new_state, plan


def _chunk(view: RequestView, start: int, chunk: int, budget: int) -> int:
    """The tokens of `view` to compute from `start`: as many as the chunk size and the budget allow, cut before a
    span of `whole_spans` the chunk would end inside (0 when the chunk starts at or inside that span)."""
    n = min(view.num_tokens - start, chunk, budget)
    for first, end in view.whole_spans:
        if first < start + n < end:
            return max(first - start, 0)
    return min([n] + [stop - start for stop in view.stops if start < stop < start + n])


def _order_key(config: SchedulerConfig) -> Callable[[RequestView], tuple[int, ...]]:
    """``config.order_key`` of a view, without the per-call policy test."""
    if config.policy == "priority":
        return operator.attrgetter("priority", "arrival_index")
    return operator.attrgetter("arrival_index")


def _count_holders(running: Iterable[RequestView]) -> collections.Counter[int]:
    return collections.Counter(p for v in running for p in v.prefix_pages)


def _with(
    view: RequestView, num_computed_tokens: int, num_pages: int, prefix_pages: tuple[int, ...] | None
) -> RequestView:
    """``view`` with new progress and pages."""
    return view._replace(
        num_computed_tokens=num_computed_tokens, num_pages=num_pages, prefix_pages=prefix_pages
    )
