"""From the live scheduler to the planner's input: a ``SchedulerState`` snapshot of its queues and pages."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from jaxserve.engine.page_pool import PagePool
from jaxserve.engine.radix_cache import RadixCache, RadixNode
from jaxserve.engine.request import Request
from jaxserve.engine.schedule import RequestView, SchedulerState
from jaxserve.engine.scheduler_config import SchedulerConfig


def cache_path(node: RadixNode | None) -> list[RadixNode]:
    """The cache nodes from ``node`` up to, not including, its root (none for None)."""
    path = []
    while node is not None and not node.is_root:
        path.append(node)
        node = node.parent
    return path


def _view(request: Request, prefix_pages: tuple[int, ...] | None) -> RequestView:
    # Positional: this runs for every running request at every step.
    return RequestView(
        request.request_id,
        request.priority,
        request.arrival_index,
        len(request.prompt_token_ids) + len(request.output_token_ids),
        len(request.output_token_ids),
        request.num_computed_tokens,
        len(request.pages),
        prefix_pages,
        request.lora_name,
        request.whole_spans,
        (request.state_stop,) if request.state_stop else (),
    )


def snapshot(
    config: SchedulerConfig,
    running: Sequence[Request],
    waiting: Sequence[Request],
    pool: PagePool,
    cache: RadixCache | None,
    *,
    step: int,
    finished_ids: Sequence[str],
) -> SchedulerState:
    """The planner's view of the queues and pages between steps, before any prefix lookup.

    A running request's shared pages are its locked cache path (the pages after
    it are its alone); waiting requests are left to be looked up, or have no
    prefix when the cache is off.
    """
    # Running requests locking each cache node (directly or below it); a node locked more often
    # than that is pinned by someone else.
    locks: dict[int, list] = {}  # node id -> [node, running locks]
    running_views = []
    for r in running:
        num_locked = 0
        node = r.cache_node
        while node is not None and node.keys:  # up to the root, which holds no pages
            locks.setdefault(node.node_id, [node, 0])[1] += 1
            num_locked += len(node.pages)
            node = node.parent
        running_views.append(_view(r, tuple(r.pages[:num_locked]) if num_locked else ()))
    pinned = [p for node, count in locks.values() if node.lock_ref > count for p in node.pages]
    # Only the head of the queue can be admitted: one request per free sequence slot at most.
    free = max(0, config.max_num_seqs - len(running))
    head = list(waiting[:free])
    if config.max_loras is not None and any(r.lora_name is not None for r in head):
        # A request passed over for its adapter takes no seat: base-model requests behind it may.
        head += itertools.islice((r for r in itertools.islice(waiting, free, None) if r.lora_name is None), free)
    waiting_views = tuple(_view(r, None if cache is not None else ()) for r in head)
    evictable = cache.num_evictable_pages if cache is not None else 0
    return SchedulerState(
        step=step,
        running=tuple(running_views),
        waiting=waiting_views,
        num_free_pages=pool.num_free + evictable,
        pinned_pages=frozenset(pinned),
        finished_ids=tuple(finished_ids),
    )


def locked_pages(node: RadixNode) -> list[int]:
    """The pages on the cache path down to ``node`` that sit in locked nodes."""
    return [p for n in cache_path(node) if n.lock_ref > 0 for p in n.pages]
