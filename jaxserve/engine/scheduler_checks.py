"""The scheduler's invariants (`Scheduler.check_integrity`): queues, pages, cache, locks and state slots."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxserve.engine.page_pool import IntegrityError, pages_needed
from jaxserve.engine.request import RequestStatus

if TYPE_CHECKING:
    from jaxserve.engine.scheduler import Scheduler


def check_scheduler(scheduler: Scheduler) -> None:
    """Raise ``IntegrityError`` unless the queues, pages, cache, locks and state slots are consistent."""
    ps = scheduler.config.page_size
    owners = [r.pages for r in scheduler.running]
    if scheduler.cache is not None:
        owners += scheduler.cache.owners()
        scheduler.cache.check_integrity(locked_nodes=[r.cache_node for r in scheduler.running if r.cache_node])
    scheduler.pool.check_integrity(owners)
    queued = sorted(id(r) for r in scheduler.waiting + scheduler.running)
    if queued != sorted(id(r) for r in scheduler._requests.values()):
        raise IntegrityError("waiting + running differ from the unfinished requests")
    if len(scheduler.running) > scheduler.config.max_num_seqs:
        raise IntegrityError(f"{len(scheduler.running)} running > max_num_seqs")
    if scheduler.config.max_loras is not None and len({r.lora_name for r in scheduler.running} - {None}) > scheduler.config.max_loras:
        raise IntegrityError("more LoRA adapters running than max_loras")
    keys = [scheduler._order_key(r) for r in scheduler.waiting]
    if keys != sorted(keys):
        raise IntegrityError("waiting queue out of policy order")
    for r in scheduler.waiting:
        if r.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            raise IntegrityError(f"waiting {r.request_id!r} has status {r.status}")
        if r.pages or r.num_computed_tokens or r.cache_node is not None:
            raise IntegrityError(f"waiting {r.request_id!r} holds pages or computed tokens")
    for r in scheduler.running:
        if r.status is not RequestStatus.RUNNING:
            raise IntegrityError(f"running {r.request_id!r} has status {r.status}")
        if not 0 <= r.num_computed_tokens < r.num_tokens:
            raise IntegrityError(f"{r.request_id!r}: {r.num_computed_tokens} computed of {r.num_tokens}")
        if len(r.pages) < pages_needed(r.num_computed_tokens, ps):
            raise IntegrityError(f"{r.request_id!r}: computed KV does not fit its pages")
        if r.cache_node is not None:
            path = scheduler.cache.path_pages(r.cache_node)
            if r.pages[: len(path)] != path:
                raise IntegrityError(f"{r.request_id!r}: locked cache path is not its page-table prefix")
    if scheduler.cache is not None:
        # _can_allocate counts on eviction freeing every unlocked cached page.
        for node in scheduler.cache.nodes():
            if node.lock_ref == 0 and any(scheduler.pool.refcount(p) != 1 for p in node.pages):
                raise IntegrityError(f"unlocked {node} has pages another owner holds")
    if scheduler.states is not None:
        slots = [r.state_slot for r in scheduler.running]
        if 0 in slots or len(set(slots)) != len(slots) or set(slots) & set(scheduler.states.free):
            raise IntegrityError(f"running requests' state slots {slots} are not distinct taken slots")
