"""A hybrid model's prefix cache: the Mamba states kept beside the cached pages (`StateSnapshots`).

A cached prefix serves a hybrid model only where its Mamba layers' states after it are kept too. Each request's
prompt has one such place, its last page boundary before its last token (`state_stop`: a prefill chunk ends there);
after the step that reaches it, the request's states are copied into a snapshot slot of the state pools, which the
radix node ending there holds. A later request matches as far as the deepest such node on its cached path and starts
from a copy of its states. A snapshot goes when its node is evicted (its pages), or, the snapshot slots all taken,
least recently used first. The copies are device work the engine runs, in order, before its next step
(`Scheduler.take_state_copies`)."""

from __future__ import annotations

from jaxserve.engine.radix_cache import RadixCache
from jaxserve.engine.radix_node import MatchResult, RadixNode


def state_stop(num_prompt_tokens: int, page_size: int) -> int:
    """Where a prompt's states are kept: its last page boundary before its last token (0: none)."""
    return (num_prompt_tokens - 1) // page_size * page_size


class StateSnapshots:
    """Snapshot slots `first` to `first + count - 1` of the state pools, each held by one radix node."""

    def __init__(self, cache: RadixCache, first: int, count: int):
        self.cache = cache
        self.free = list(range(first + count - 1, first - 1, -1))
        self.held: dict[int, tuple[RadixNode, int]] = {}  # node id -> (node, slot)

    def _sweep(self) -> None:
        """Give back the slots of nodes no longer cached (evicted, reset)."""
        for node_id, (node, slot) in list(self.held.items()):
            if not self.cache.is_attached(node):
                del self.held[node_id]
                self.free.append(slot)

    def slot_of(self, node: RadixNode) -> int | None:
        entry = self.held.get(node.node_id)
        return entry[1] if entry is not None and self.cache.is_attached(node) else None

    def usable(self, match: MatchResult) -> MatchResult:
        """`match` cut back to the deepest node on its path whose states are kept (the root: nothing)."""
        node = match.last_node
        while not node.is_root and self.slot_of(node) is None:
            node = node.parent
        pages = tuple(self.cache.path_pages(node))
        return MatchResult(pages, len(pages) * self.cache.page_size, node)

    def keep(self, node: RadixNode) -> int | None:
        """A slot for the states at the end of `node` (None: kept already); the least recently used snapshot gives
        its slot up when none is free."""
        if self.slot_of(node) is not None or not self.free and not self.held:  # (kept, or no snapshot slots)
            return None
        self._sweep()
        if not self.free:
            oldest = min(self.held, key=lambda i: (self.held[i][0].last_access, i))
            self.free.append(self.held.pop(oldest)[1])
        slot = self.free.pop()
        self.held[node.node_id] = (node, slot)
        return slot

    def __len__(self) -> int:
        self._sweep()
        return len(self.held)
