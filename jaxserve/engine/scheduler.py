"""The batch scheduler: which requests run in the next step, how many tokens each, in which KV pages."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from jaxserve.engine.page_pool import IntegrityError, PagePool, pages_needed
from jaxserve.engine.radix_cache import RadixCache
from jaxserve.engine.request import Request, RequestStatus

Policy = Literal["fcfs", "priority"]


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits and policy of the scheduler."""

    max_num_seqs: int = 256
    """Most requests running at once (each running request is scheduled every step)."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step: decode tokens plus prefill chunk tokens."""
    max_model_len: int = 8192
    """Most tokens (prompt plus output) a request may reach."""
    page_size: int = 16
    """Tokens per KV page, a power of two."""
    long_prefill_token_threshold: int | None = None
    """Largest prefill chunk one request gets per step (None: only the token budget limits it)."""
    policy: Policy = "fcfs"
    """``"fcfs"``: arrival order; ``"priority"``: lower ``Request.priority`` first, arrival order within one."""
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Otherwise a full batch of decodes would not fit in one step's budget.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs})"
            )
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 1:
            raise ValueError(
                f"long_prefill_token_threshold must be >= 1, got {self.long_prefill_token_threshold}"
            )
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")

    @property
    def prefill_chunk_size(self) -> int:
        """The most prefill tokens one request is given in one step."""
        return self.long_prefill_token_threshold or self.max_num_batched_tokens


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: feed ``token_ids`` at positions ``start_position`` onwards."""

    request_id: str
    num_new_tokens: int
    start_position: int
    """Tokens already computed (their KV is in the pages): the position of ``token_ids[0]``."""
    token_ids: tuple[int, ...]
    page_table: tuple[int, ...]
    """The request's KV pages, covering at least ``start_position + num_new_tokens`` positions."""
    sample: bool
    """True when the step feeds the request's last known token, so the logits of that token are
    sampled: every decode, and the chunk that completes a prefill."""
    is_decode: bool
    """True for a running request's one-token decode step (these come first in the step)."""


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan; ``scheduled`` lists decodes first, then prefill chunks."""

    step: int
    scheduled: tuple[ScheduledRequest, ...]
    preempted_ids: tuple[str, ...]
    """Requests preempted in this step (their pages are freed; they will recompute)."""
    finished_ids: tuple[str, ...]
    """Requests finished or aborted since the previous step (a runner drops their state)."""

    @property
    def num_batched_tokens(self) -> int:
        """Tokens fed in this step."""
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """Whether nothing runs in this step."""
        return not self.scheduled


class Scheduler:
    """Continuous batching over a paged KV pool with a radix prefix cache, in plain Python.

    ``schedule()`` is a deterministic function of the scheduler's state (no
    clocks, no randomness, no ``hash``): replaying the same calls gives the same
    outputs. The loop around it is: ``out = schedule()``; run the model on
    ``out``; ``update_after_step(out, sampled, stopped)``. One thread drives it
    (no locking inside).

    Policy of one step:
      1. Running requests, decodes first then unfinished prefills, each in
         policy order: one token per decode, a chunk of at most
         ``prefill_chunk_size`` tokens per prefill, within the token budget.
         A request that needs a page when none is free (after evicting the
         prefix cache) preempts the least important running request (under
         ``"priority"`` the largest priority value, then the newest; under
         ``"fcfs"`` the newest), possibly itself, possibly one scheduled
         earlier in the step (which gives its tokens back). A preempted request frees its
         pages (its computed full pages go to the prefix cache first, so the
         recompute usually hits them) and goes back to the waiting queue ahead
         of later arrivals.
      2. If nothing was preempted, waiting requests in policy order while the
         budget and ``max_num_seqs`` allow: each reuses its longest cached
         prefix, leaving at least one token to compute so the model yields
         logits, and takes pages for its first chunk. Admission stops at the
         first request that does not fit (no skipping, so no starvation);
         admission never preempts.

    Pages: every page in a request's page table carries one pool reference for
    that request; cached pages carry one more for the cache. A request's
    full computed pages enter the prefix cache when its prefill completes (so
    concurrent requests with the same prefix share them), when it finishes,
    is preempted or aborted.
    """

    def __init__(self, config: SchedulerConfig, num_pages: int) -> None:
        self.config = config
        self.pool = PagePool(num_pages, config.page_size)
        self.cache = RadixCache(self.pool) if config.enable_prefix_caching else None
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
        """Smaller runs first and is preempted last."""
        priority = request.priority if self.config.policy == "priority" else 0
        return (priority, request.arrival_index)

    # -- requests in and out ---------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request; raises ValueError if it could never run in this pool."""
        cfg = self.config
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id!r} is already queued")
        if request.status is not RequestStatus.WAITING or request.pages or request.output_token_ids:
            raise ValueError(f"request {request.request_id!r} is not a fresh request")
        if request.num_prompt_tokens >= cfg.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt of {request.num_prompt_tokens} tokens leaves no room "
                f"to generate within max_model_len={cfg.max_model_len}"
            )
        # A request's last token never has its KV computed, hence the -1.
        longest = min(request.num_prompt_tokens + request.max_tokens, cfg.max_model_len) - 1
        if pages_needed(longest, cfg.page_size) > self.pool.num_usable_pages:
            raise ValueError(
                f"request {request.request_id!r} may need {pages_needed(longest, cfg.page_size)} KV pages, "
                f"more than the pool's {self.pool.num_usable_pages}"
            )
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

    def _can_allocate(self, n: int) -> bool:
        # Unlocked cached pages are held by the cache alone (check_integrity verifies it), so
        # evicting them frees them.
        evictable = self.cache.num_evictable_pages if self.cache is not None else 0
        return n <= self.pool.num_free + evictable

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

    def _cache_unfinished(self, request: Request) -> None:
        """Share a running request's full computed pages through the cache and lock them for it."""
        ps = self.config.page_size
        num_full = request.num_computed_tokens // ps
        if self.cache is None or not num_full:
            return
        result = self.cache.insert(
            request.token_ids_in(0, num_full * ps), request.pages[:num_full], request.cache_salt
        )
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
        n = min(
            n, request.max_tokens - request.num_output_tokens, self.config.max_model_len - request.num_tokens
        )
        ps = self.config.page_size
        need = pages_needed(request.num_computed_tokens + n, ps) - len(request.pages)
        evictable = self.cache.num_evictable_pages if self.cache is not None else 0
        take = min(need, self.pool.num_free + evictable)
        if take > 0:
            request.pages.extend(self._allocate(take))
        return max(0, min(n, len(request.pages) * ps - request.num_computed_tokens))

    # -- one step --------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan the next step (see the class docstring for the policy)."""
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        chunk = cfg.prefill_chunk_size
        num_new: dict[str, int] = {}  # insertion order is the output order
        preempted: list[Request] = []

        decodes = sorted((r for r in self.running if r.is_decoding), key=self._order_key)
        prefills = sorted((r for r in self.running if not r.is_decoding), key=self._order_key)
        # Fixed here: a request admitted below may also need just one token (a cache hit up to its
        # last token), but it is placed, and reported, as a prefill.
        decode_ids = {r.request_id for r in decodes}
        for request in decodes + prefills:
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if budget == 0:
                break
            while True:
                n = min(request.num_uncomputed_tokens, chunk, budget)
                need = pages_needed(request.num_computed_tokens + n, cfg.page_size) - len(request.pages)
                if need <= 0 or self._can_allocate(need):
                    break
                victim = max(self.running, key=self._order_key)
                # A victim scheduled earlier in this loop gives its tokens back.
                budget += num_new.pop(victim.request_id, 0)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue
            if need > 0:
                request.pages.extend(self._allocate(need))
            num_new[request.request_id] = n
            budget -= n

        # Preemption means memory is short: admitting now would only thrash.
        while not preempted and self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            n = self._admit(self.waiting[0], min(chunk, budget))
            if n == 0:
                break
            request = self.waiting.pop(0)
            self.running.append(request)
            num_new[request.request_id] = n
            budget -= n

        scheduled = []
        for request_id, n in num_new.items():
            request = self._requests[request_id]
            start = request.num_computed_tokens
            scheduled.append(
                ScheduledRequest(
                    request_id=request_id,
                    num_new_tokens=n,
                    start_position=start,
                    token_ids=tuple(request.token_ids_in(start, start + n)),
                    page_table=tuple(request.pages),
                    sample=start + n == request.num_tokens,
                    is_decode=request_id in decode_ids,
                )
            )
        output = SchedulerOutput(
            step=self._step,
            scheduled=tuple(scheduled),
            preempted_ids=tuple(r.request_id for r in preempted),
            finished_ids=tuple(self._finished_ids),
        )
        self._finished_ids = []
        self._step += 1
        return output

    def _admit(self, request: Request, max_tokens: int) -> int:
        """Give a waiting request its cached prefix and pages for its first chunk; returns the chunk (0: no room)."""
        ps = self.config.page_size
        cached_pages: list[int] = []
        num_cached = 0
        node = None
        if self.cache is not None:
            # Match all but the last token: at least one token must be computed to get logits.
            match = self.cache.match_prefix(
                request.token_ids_in(0, request.num_tokens - 1), request.cache_salt, record=False
            )
            cached_pages, num_cached = list(match.pages), match.num_tokens
            if not match.last_node.is_root:
                node = match.last_node
                self.cache.lock(node)  # before evicting for our new pages, which must not take these
        n = min(request.num_tokens - num_cached, max_tokens)
        need = pages_needed(num_cached + n, ps) - len(cached_pages)
        if not self._can_allocate(need):
            if node is not None:
                self.cache.unlock(node)
            return 0
        self.pool.incref(cached_pages)
        request.pages = cached_pages + self._allocate(need)
        request.cache_node = node
        request.num_computed_tokens = num_cached
        request.status = RequestStatus.RUNNING
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_cached
            if self.cache is not None:
                self.cache.record_lookup(request.num_prompt_tokens, num_cached)
        return n

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
            self.running.remove(request)
            self._release(request)
            request.status = status
            del self._requests[s.request_id]
            self._finished_ids.append(s.request_id)
            finished.append(request)
        return finished

    # -- checking --------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise ``IntegrityError`` unless the queues, pages, cache and locks are consistent."""
        ps = self.config.page_size
        owners = [r.pages for r in self.running]
        if self.cache is not None:
            owners += self.cache.owners()
            self.cache.check_integrity(locked_nodes=[r.cache_node for r in self.running if r.cache_node])
        self.pool.check_integrity(owners)
        queued = sorted(id(r) for r in self.waiting + self.running)
        if queued != sorted(id(r) for r in self._requests.values()):
            raise IntegrityError("waiting + running differ from the unfinished requests")
        if len(self.running) > self.config.max_num_seqs:
            raise IntegrityError(f"{len(self.running)} running > max_num_seqs")
        keys = [self._order_key(r) for r in self.waiting]
        if keys != sorted(keys):
            raise IntegrityError("waiting queue out of policy order")
        for r in self.waiting:
            if r.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                raise IntegrityError(f"waiting {r.request_id!r} has status {r.status}")
            if r.pages or r.num_computed_tokens or r.cache_node is not None:
                raise IntegrityError(f"waiting {r.request_id!r} holds pages or computed tokens")
        for r in self.running:
            if r.status is not RequestStatus.RUNNING:
                raise IntegrityError(f"running {r.request_id!r} has status {r.status}")
            if not 0 <= r.num_computed_tokens < r.num_tokens:
                raise IntegrityError(f"{r.request_id!r}: {r.num_computed_tokens} computed of {r.num_tokens}")
            if len(r.pages) < pages_needed(r.num_computed_tokens, ps):
                raise IntegrityError(f"{r.request_id!r}: computed KV does not fit its pages")
            if r.cache_node is not None:
                path = self.cache.path_pages(r.cache_node)
                if r.pages[: len(path)] != path:
                    raise IntegrityError(f"{r.request_id!r}: locked cache path is not its page-table prefix")
        if self.cache is not None:
            # _can_allocate counts on eviction freeing every unlocked cached page.
            for node in self.cache.nodes():
                if node.lock_ref == 0 and any(self.pool.refcount(p) != 1 for p in node.pages):
                    raise IntegrityError(f"unlocked {node} has pages another owner holds")
