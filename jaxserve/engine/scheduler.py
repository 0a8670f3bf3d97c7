"""The batch scheduler: which requests run in the next step, how many tokens each, in which KV pages."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence

from jaxserve.engine.page_pool import IntegrityError, PagePool, StateSlots, pages_needed
from jaxserve.engine.radix_cache import MatchResult, RadixCache
from jaxserve.engine.request import Request, RequestStatus
from jaxserve.engine.schedule import PageAction, Planner
from jaxserve.engine.schedule_snapshot import locked_pages, snapshot
from jaxserve.engine.scheduler_checks import check_scheduler
from jaxserve.engine.scheduler_config import SchedulerConfig
from jaxserve.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from jaxserve.engine.state_cache import StateSnapshots, state_stop

__all__ = ["ScheduledRequest", "Scheduler", "SchedulerConfig", "SchedulerOutput"]


class Scheduler:
    """Continuous batching over a paged KV pool with a radix prefix cache: the shell around ``schedule``.

    ``schedule()`` snapshots the queues and page counts into a
    ``SchedulerState``, lets the pure planner (``jaxserve.engine.schedule``,
    which states the policy) decide the step, then applies the plan's page
    actions to the pool and the cache. Nothing here reads a clock, draws a
    random number or uses ``hash``: replaying the same calls gives the same
    outputs. The loop around it is: ``out = schedule()``; run the model on
    ``out``; ``update_after_step(out, sampled, stopped)``. One thread drives it
    (no locking inside).

    Pages: every page in a request's page table carries one pool reference for
    that request; cached pages carry one more for the cache. A request's
    full computed pages enter the prefix cache when its prefill completes (so
    concurrent requests with the same prefix share them), when it finishes,
    is preempted (so its recompute usually hits them) or aborted. An admitted
    request reuses its longest cached prefix, leaving at least one token to
    compute so the model yields logits.
    """

    def __init__(self, config: SchedulerConfig, num_pages: int) -> None:
        self.config = config
        self.pool = PagePool(num_pages, config.page_size)
        self.cache = RadixCache(self.pool) if config.enable_prefix_caching else None
        self.states = StateSlots(config.num_state_slots) if config.num_state_slots else None
        self.snapshots = (StateSnapshots(self.cache, config.first_snapshot_slot or config.num_state_slots,
                                         config.num_state_snapshots)
                          if self.cache is not None and self.states is not None else None)  # (hits need states)
        self._state_copies: list[tuple[int, int]] = []  # (from slot, to slot), in order (`take_state_copies`)
        self.waiting: list[Request] = []
        """Waiting and preempted requests, in policy order."""
        self.running: list[Request] = []
        """Admitted requests, in admission order."""
        self._requests: dict[str, Request] = {}
        self._next_arrival = 0
        self._step = 0
        self._finished_ids: list[str] = []

    # -- queries ---------------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        """Requests waiting (new or preempted)."""
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        """Requests admitted and holding pages."""
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self._requests)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None."""
        return self._requests.get(request_id)

    def _order_key(self, request: Request) -> tuple[int, int]:
        return self.config.order_key(request.priority, request.arrival_index)

    # -- requests in and out ---------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request; raises ValueError if it could never run in this pool."""
        cfg = self.config
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id!r} is already queued")
        if request.status is not RequestStatus.WAITING or request.pages or request.output_token_ids:
            raise ValueError(f"request {request.request_id!r} is not a fresh request")
        if request.num_prompt_tokens >= cfg.max_model_len + request.pooling:
            raise ValueError(
                f"request {request.request_id!r}: prompt of {request.num_prompt_tokens} tokens leaves no room "
                f"to generate within max_model_len={cfg.max_model_len}"
            )
        # A request's last token never has its KV computed, hence the -1; an embedding's prompt is all computed.
        longest = (request.num_prompt_tokens if request.pooling
                   else min(request.num_prompt_tokens + request.max_tokens, cfg.max_model_len) - 1)
        if pages_needed(longest, cfg.page_size) > self.pool.num_usable_pages:
            raise ValueError(
                f"request {request.request_id!r} may need {pages_needed(longest, cfg.page_size)} KV pages, "
                f"more than the pool's {self.pool.num_usable_pages}"
            )
        if self.snapshots is not None:
            request.state_stop = state_stop(request.num_prompt_tokens, cfg.page_size)
        request.arrival_index = self._next_arrival
        self._next_arrival += 1
        self._requests[request.request_id] = request
        bisect.insort(self.waiting, request, key=self._order_key)

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is, freeing its pages; False if it is unknown or already finished."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._release(request)
        else:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED_ABORTED
        self._finished_ids.append(request_id)
        return True

    # -- pages -----------------------------------------------------------------------------------

    def _allocate(self, n: int) -> list[int]:
        if self.pool.num_free < n and self.cache is not None:
            self.cache.evict(n - self.pool.num_free)
        return self.pool.allocate(n)

    def _release(self, request: Request) -> None:
        """Give the request's full computed pages to the cache, then drop its locks and references."""
        ps = self.config.page_size
        num_full = request.num_computed_tokens // ps
        if self.cache is not None and num_full:
            self.cache.insert(
                request.token_ids_in(0, num_full * ps), request.pages[:num_full], request.cache_salt
            )
        if request.cache_node is not None:
            self.cache.unlock(request.cache_node)
            request.cache_node = None
        self.pool.decref(request.pages)
        request.pages = []
        if self.states is not None:
            self.states.give(request)

    def _cache_unfinished(self, request: Request) -> None:
        """Share a running request's full computed pages through the cache and lock them for it."""
        ps = self.config.page_size
        num_full = request.num_computed_tokens // ps
        if self.cache is None or not num_full:
            return
        result = self.cache.insert(request.token_ids_in(0, num_full * ps), request.pages[:num_full], request.cache_salt)
        # Where another request cached the same prefix first, switch to its pages (same tokens at the
        # same positions, so the same KV) and free ours, so the prefix is stored once.
        for i, page in enumerate(result.pages):
            if request.pages[i] != page:
                self.pool.incref([page])
                self.pool.decref([request.pages[i]])
                request.pages[i] = page
        self.cache.lock(result.last_node)
        if request.cache_node is not None:
            self.cache.unlock(request.cache_node)
        request.cache_node = result.last_node

    def _keep_state(self, request: Request) -> None:
        """Cache a hybrid model's request's prompt up to its `state_stop` (its computed tokens), with its states."""
        self._cache_unfinished(request)
        slot = self.snapshots.keep(request.cache_node)
        if slot is not None:
            self._state_copies.append((request.state_slot, slot))

    def roll_back(self, request: Request, position: int, backup: int) -> None:
        """A hybrid model's request whose states ran past its accepted drafts: its states back from slot `backup`,
        its tokens from `position` on computed again."""
        request.num_computed_tokens = position
        self._state_copies.append((backup, request.state_slot))

    def take_state_copies(self) -> list[tuple[int, int]]:
        """The state copies (from slot, to slot) to make, in order, before the next step runs; forgotten here."""
        copies, self._state_copies = self._state_copies, []
        return copies

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        bisect.insort(self.waiting, request, key=self._order_key)

    def reserve_decode_pages(self, request_id: str, n: int) -> int:
        """Give a decoding request pages for its next ``n`` positions, for a device loop of ``n`` decode steps.

        Call after ``schedule()``; the extended page table is ``get_request(request_id).pages``.
        ``n`` is capped by the request's remaining ``max_tokens`` and ``max_model_len``;
        pages come from the free pool and the prefix cache, never by preemption.
        Returns the number of decode steps the request's pages now cover.
        """
        request = self._requests.get(request_id)
        if request is None or request.status is not RequestStatus.RUNNING or not request.is_decoding:
            raise ValueError(f"request {request_id!r} is not a running decode")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        n = min(n, request.max_tokens - request.num_output_tokens, self.config.max_model_len - request.num_tokens)
        ps = self.config.page_size
        need = pages_needed(request.num_computed_tokens + n, ps) - len(request.pages)
        evictable = self.cache.num_evictable_pages if self.cache is not None else 0
        take = min(need, self.pool.num_free + evictable)
        if take > 0:
            request.pages.extend(self._allocate(take))
        return max(0, min(n, len(request.pages) * ps - request.num_computed_tokens))

    # -- one step --------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan the next step with the pure planner, applying its page actions as it goes."""
        state = snapshot(
            self.config,
            self.running,
            self.waiting,
            self.pool,
            self.cache,
            step=self._step,
            finished_ids=self._finished_ids,
        )
        planner = Planner(state, self.config)
        lookups: dict[str, MatchResult] = {}
        num_applied = 0
        while True:
            lookup_id = planner.advance()
            self._apply(planner.actions[num_applied:], lookups)
            num_applied = len(planner.actions)
            if lookup_id is None:
                break
            # Looked up only now, after the allocations planned before it (which may evict), and
            # only for requests admission reaches: a lookup refreshes the prefix's LRU age.
            request = self._requests[lookup_id]
            # A request that reads no cached prefix matches the empty one (no pages).
            end = request.num_tokens - 1 if request.read_prefix_cache else 0
            match = self.cache.match_prefix(request.token_ids_in(0, end), request.cache_salt, record=False)
            if self.snapshots is not None:  # (a hybrid model: as far as states are kept)
                match = self.snapshots.usable(match)
            lookups[lookup_id] = match
            planner.provide_prefix(lookup_id, match.pages, locked_pages(match.last_node))
        _, plan = planner.result()
        scheduled = []
        for s in plan.scheduled:
            request = self._requests[s.request_id]
            token_ids = tuple(request.token_ids_in(s.start_position, s.start_position + s.num_new_tokens))
            scheduled.append(
                ScheduledRequest(
                    s.request_id,
                    s.num_new_tokens,
                    s.start_position,
                    token_ids,
                    tuple(request.pages),
                    s.sample,
                    s.is_decode,
                )
            )
        output = SchedulerOutput(
            step=self._step,
            scheduled=tuple(scheduled),
            preempted_ids=plan.preempted_ids,
            finished_ids=tuple(self._finished_ids),
        )
        self._finished_ids = []
        self._step += 1
        return output

    def _apply(self, actions: Iterable[PageAction], lookups: Mapping[str, MatchResult]) -> None:
        """Carry out planned page actions on the queues, the pool and the cache."""
        for action in actions:
            request = self._requests[action.request_id]
            if action.kind == "preempt":
                self._preempt(request)
            elif action.kind == "grow":
                request.pages.extend(self._allocate(action.num_pages))
            else:
                self._admit(request, lookups.get(action.request_id), action.num_pages)

    def _admit(self, request: Request, match: MatchResult | None, num_new_pages: int) -> None:
        """Move a waiting request (the head, or a base-model request behind adapter requests passed over) to running."""
        i = self.waiting.index(request)
        if i and (request.lora_name is not None or any(r.lora_name is None for r in self.waiting[:i])):
            raise IntegrityError(f"admitting {request.request_id!r} out of policy order")
        cached_pages: list[int] = []
        num_cached = 0
        if match is not None and not match.last_node.is_root:
            cached_pages, num_cached = list(match.pages), match.num_tokens
            self.cache.lock(match.last_node)  # before allocating, which may evict: not these
            request.cache_node = match.last_node
        self.pool.incref(cached_pages)
        request.pages = cached_pages + self._allocate(num_new_pages)
        request.num_computed_tokens = num_cached
        request.status = RequestStatus.RUNNING
        if self.states is not None:
            self.states.take(request)
            if num_cached:  # its states after the cached prefix, from the snapshot there
                self._state_copies.append((self.snapshots.slot_of(match.last_node), request.state_slot))
        self.running.append(self.waiting.pop(i))
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_cached
            if self.cache is not None:
                self.cache.record_lookup(request.num_prompt_tokens, num_cached)

    def update_after_step(
        self,
        output: SchedulerOutput,
        sampled_token_ids: Mapping[str, Sequence[int]],
        stopped: Iterable[str] = (),
    ) -> list[Request]:
        """Apply a finished step: advance computed tokens, append sampled tokens, finish requests.

        ``sampled_token_ids`` maps each request with ``sample=True`` to its new
        tokens: one, or several after a multi-step decode loop (covered by
        ``reserve_decode_pages``). ``stopped`` names requests the caller ended
        (a stop token or string) with their last sampled token. Requests
        reaching ``max_tokens`` or ``max_model_len`` finish with
        FINISHED_LENGTH (extra tokens beyond the limit are dropped). Requests
        aborted since ``schedule()`` are skipped. Returns the requests that
        finished in this update.
        """
        cfg = self.config
        stopped = set(stopped)
        finished = []
        for s in output.scheduled:
            request = self._requests.get(s.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            if request.num_computed_tokens != s.start_position:
                raise ValueError(
                    f"stale output for {s.request_id!r}: planned at position {s.start_position}, "
                    f"request is at {request.num_computed_tokens}"
                )
            tokens = list(sampled_token_ids.get(s.request_id, ()))
            if not s.sample:
                if tokens or s.request_id in stopped:
                    raise ValueError(f"{s.request_id!r} did not sample in this step (prefill chunk)")
                request.num_computed_tokens += s.num_new_tokens
                if request.state_stop and request.num_computed_tokens == request.state_stop:
                    self._keep_state(request)
                continue
            if request.pooling:  # its prompt is computed: the embedding is out
                if tokens:
                    raise ValueError(f"{s.request_id!r} is an embedding request; it samples no token")
                request.num_computed_tokens += s.num_new_tokens
                finished.append(self._finish(request, RequestStatus.FINISHED_STOPPED))
                continue
            if not tokens:
                raise ValueError(f"{s.request_id!r} sampled in this step but no token was given")
            room = min(request.max_tokens - request.num_output_tokens, cfg.max_model_len - request.num_tokens)
            tokens = tokens[:room]
            # A loop of k decode steps computes the KV of every token it feeds: all but the last sampled.
            computed = s.start_position + s.num_new_tokens + len(tokens) - 1
            if computed > len(request.pages) * cfg.page_size:
                raise ValueError(
                    f"{s.request_id!r}: {len(tokens)} tokens need KV up to position {computed}, "
                    f"beyond its {len(request.pages)} pages (reserve_decode_pages first)"
                )
            request.output_token_ids.extend(tokens)
            request.num_computed_tokens = computed
            if s.request_id in stopped:
                status = RequestStatus.FINISHED_STOPPED
            elif request.num_output_tokens >= request.max_tokens or request.num_tokens >= cfg.max_model_len:
                status = RequestStatus.FINISHED_LENGTH
            else:
                if not s.is_decode:
                    self._cache_unfinished(request)
                continue
            finished.append(self._finish(request, status))
        return finished

    def _finish(self, request: Request, status: RequestStatus) -> Request:
        self.running.remove(request)
        self._release(request)
        request.status = status
        del self._requests[request.request_id]
        self._finished_ids.append(request.request_id)
        return request

    # -- checking --------------------------------------------------------------------------------

    @property
    def kv_cache_usage(self) -> float:
        """Share of pages held by requests; pages only the prefix cache keeps count as free (they are
        evicted on demand), as vLLM reports `kv_cache_usage_perc`."""
        held = self.pool.num_used - (self.cache.num_evictable_pages if self.cache is not None else 0)
        return held / self.pool.num_usable_pages

    def check_integrity(self) -> None:
        """Raise ``IntegrityError`` unless the queues, pages, cache, locks and state slots are consistent."""
        check_scheduler(self)
