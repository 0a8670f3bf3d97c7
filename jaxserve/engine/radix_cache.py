"""The prefix cache: a radix tree over full KV pages, evicted least recently used first."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence

from jaxserve.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, hash_block
from jaxserve.engine.page_pool import IntegrityError, PagePool
from jaxserve.engine.radix_node import InsertResult, MatchResult, PageKey, RadixNode

# Re-exported: the scheduler and the KV transfer import the node and result types from here.
__all__ = ["InsertResult", "MatchResult", "PageKey", "RadixCache", "RadixNode"]


class RadixCache:
    """A page-granular radix tree of cached KV pages, keyed by token ids and an optional cache salt.

    Invariants (``check_integrity`` verifies them):
      - only full pages are cached; a node's ``keys``, ``pages`` and ``hashes``
        have one entry per page, and a non-root node has at least one page;
      - a child is stored under the token ids of its first page, and siblings
        differ in that first page;
      - each cached page appears in exactly one node, and the cache holds one
        pool reference on it (``insert`` adds it, eviction and ``reset`` drop it);
      - ``hashes`` chain from the root: each is ``hash_block(previous, keys[i], salt)``;
      - ``lock_ref`` of a node = locks taken on it + sum of its children's
        ``lock_ref``; a node with ``lock_ref > 0`` (locked or an ancestor of a
        locked node) is never evicted;
      - each cache salt has its own root, so requests with different salts
        never match each other's pages; a root with no children is dropped.

    Ownership: the cache never takes or drops a caller's page references. A
    caller that matched pages and wants to keep using them increfs them in the
    pool and locks ``last_node``; ``insert`` adds the cache's own reference to the
    pages it stores, so the caller still frees all of its pages as usual
    (including ``redundant_pages``, which are then freed if no one else holds them).

    LRU uses a logical clock (one tick per match or insert), so eviction order is
    deterministic. Every change to the set of cached pages is published to the
    subscribers as a ``KVEvent``.
    """

    def __init__(self, pool: PagePool) -> None:
        self._pool = pool
        self._page_size = pool.page_size
        self._roots: dict[str | None, RadixNode] = {}
        self._subscribers: list[Callable[[KVEvent], None]] = []
        self._ids = itertools.count(1)
        self._clock = 0
        self._num_evictable = 0
        self._num_locked = 0
        self.query_tokens = 0
        """Tokens looked up (``match_prefix`` with ``record=True``, or ``record_lookup``)."""
        self.hit_tokens = 0
        """Of those, tokens found cached."""

    # -- introspection ---------------------------------------------------------------------------

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self._page_size

    @property
    def num_cached_pages(self) -> int:
        """Pages held by the cache."""
        return self._num_evictable + self._num_locked

    @property
    def num_evictable_pages(self) -> int:
        """Cached pages in unlocked nodes: ``evict`` can remove all of them."""
        return self._num_evictable

    @property
    def num_locked_pages(self) -> int:
        """Cached pages in use by running requests (locked nodes and their ancestors)."""
        return self._num_locked

    @property
    def hit_rate(self) -> float:
        """``hit_tokens / query_tokens`` (0 before any lookup)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def subscribe(self, callback: Callable[[KVEvent], None]) -> None:
        """Call ``callback(event)`` for every later event, synchronously, in order."""
        self._subscribers.append(callback)

    def unsubscribe(self, callback: Callable[[KVEvent], None]) -> None:
        """Stop calling ``callback``."""
        self._subscribers.remove(callback)

    def _emit(self, event: KVEvent) -> None:
        for callback in self._subscribers:
            callback(event)

    def nodes(self) -> Iterator[RadixNode]:
        """Every non-root node, parents before children."""
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            if not node.is_root:
                yield node
            stack.extend(node.children.values())

    def owners(self) -> list[list[int]]:
        """The pages of each node: the cache's share of the owners for ``PagePool.check_integrity``."""
        return [list(node.pages) for node in self.nodes()]

    def block_hashes(self) -> list[int]:
        """Hashes of every cached page."""
        return [h for node in self.nodes() for h in node.hashes]

    def path_pages(self, node: RadixNode) -> list[int]:
        """The pages from the root down to and including ``node``."""
        self._check_live(node)
        runs = []
        while not node.is_root:
            runs.append(node.pages)
            node = node.parent
        return [page for run in reversed(runs) for page in run]

    def is_attached(self, node: RadixNode) -> bool:
        """Whether ``node`` is still in the tree (not evicted, not dropped by ``reset``)."""
        while not node.is_root:
            parent = node.parent
            if parent is None or parent.children.get(node.keys[0]) is not node:
                return False
            node = parent
        return self._roots.get(node.salt) is node

    # -- lookups ---------------------------------------------------------------------------------

    def _page_keys(self, token_ids: Sequence[int]) -> list[PageKey]:
        ps = self._page_size
        return [tuple(token_ids[i : i + ps]) for i in range(0, len(token_ids) - ps + 1, ps)]

    def _root(self, salt: str | None) -> RadixNode:
        # An unknown salt gets a fresh root, registered only once it gets a child.
        return self._roots.get(salt) or RadixNode(next(self._ids), [], [], [], None, salt)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _split(self, node: RadixNode, n: int) -> RadixNode:
        """Cut ``node`` after its first ``n`` pages; return the new upper part (same locks, same age)."""
        upper = RadixNode(
            next(self._ids), node.keys[:n], node.pages[:n], node.hashes[:n], node.parent, node.salt
        )
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        node.keys, node.pages, node.hashes = node.keys[n:], node.pages[n:], node.hashes[n:]
        node.parent.children[upper.keys[0]] = upper
        node.parent = upper
        upper.children[node.keys[0]] = node
        return upper

    def _descend(self, node: RadixNode, keys: list[PageKey], now: int) -> tuple[RadixNode, int]:
        """Follow ``keys`` from ``node`` as far as cached, splitting so the walk ends at a node boundary."""
        i = 0
        while i < len(keys):
            child = node.children.get(keys[i])
            if child is None:
                break
            n = 1
            while n < len(child.keys) and i + n < len(keys) and child.keys[n] == keys[i + n]:
                n += 1
            if n < len(child.keys):
                child = self._split(child, n)
            child.last_access = now
            node = child
            i += n
        return node, i

    def match_prefix(
        self, token_ids: Sequence[int], salt: str | None = None, *, record: bool = True
    ) -> MatchResult:
        """Longest cached prefix of ``token_ids`` in whole pages, under ``salt``; refreshes its LRU age.

        Takes no references and no lock: a caller that will use the pages increfs
        them and calls ``lock(result.last_node)``. ``record=False`` leaves the hit
        counters alone (for lookups that may be retried; see ``record_lookup``).
        """
        now = self._tick()
        node, num_pages = self._descend(self._root(salt), self._page_keys(token_ids), now)
        if record:
            self.record_lookup(len(token_ids), num_pages * self._page_size)
        return MatchResult(tuple(self.path_pages(node)), num_pages * self._page_size, node)

    def record_lookup(self, query_tokens: int, hit_tokens: int) -> None:
        """Add one lookup to the hit counters."""
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens

    # -- updates ---------------------------------------------------------------------------------

    def insert(self, token_ids: Sequence[int], pages: Sequence[int], salt: str | None = None) -> InsertResult:
        """Cache the full pages of ``token_ids``, whose KV lives in ``pages`` (one page per full page).

        Already cached pages are kept and the caller's copies reported in
        ``redundant_pages``; the rest are stored with one new pool reference
        each. ``pages`` may be longer than the full pages (a trailing partial
        page is ignored). The caller's own references are untouched.
        """
        keys = self._page_keys(token_ids)
        if len(pages) < len(keys):
            raise ValueError(f"{len(keys)} full pages of tokens but only {len(pages)} pages given")
        now = self._tick()
        node, i = self._descend(self._root(salt), keys, now)
        cached = self.path_pages(node)
        redundant = tuple(mine for mine, theirs in zip(pages[:i], cached, strict=True) if mine != theirs)
        if i < len(keys):
            new_pages = list(pages[i : len(keys)])
            self._pool.incref(new_pages)
            parent_hash = node.hashes[-1] if not node.is_root else None
            hashes, h = [], parent_hash
            for key in keys[i:]:
                h = hash_block(h, key, salt)
                hashes.append(h)
            child = RadixNode(next(self._ids), keys[i:], new_pages, hashes, node, salt)
            child.last_access = now
            node.children[keys[i]] = child
            if node.is_root:
                self._roots[salt] = node
            self._num_evictable += len(new_pages)
            token_run = tuple(t for key in keys[i:] for t in key)
            self._emit(BlockStored(tuple(hashes), parent_hash, token_run, self._page_size))
            cached.extend(new_pages)
            node = child
        return InsertResult(tuple(cached), redundant, i * self._page_size, node)

    @staticmethod
    def _check_live(node: RadixNode) -> None:
        if not node.is_root and node.parent is None:
            raise ValueError(f"{node} is no longer cached (evicted or reset)")

    def lock(self, node: RadixNode) -> None:
        """Protect ``node`` and its ancestors from eviction until the matching ``unlock``."""
        self._check_live(node)
        while not node.is_root:
            if node.lock_ref == 0:
                self._num_evictable -= len(node.pages)
                self._num_locked += len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        """Undo one ``lock(node)``."""
        self._check_live(node)
        while not node.is_root:
            if node.lock_ref <= 0:
                raise ValueError(f"unlock of {node} which is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._num_evictable += len(node.pages)
                self._num_locked -= len(node.pages)
            node = node.parent

    def evict(self, num_pages: int) -> list[int]:
        """Remove unlocked leaf pages, least recently used leaf first, until ``num_pages`` pages were freed.

        Returns the pages returned to the pool: exactly ``num_pages`` when that
        many are evictable (no caller shares an unlocked page), fewer otherwise.
        Of a leaf, only its deepest pages go when fewer are needed: the pages
        nearer the root stay, as they serve every longer prefix too.
        """
        freed: list[int] = []
        if num_pages <= 0:
            return freed
        heap = [(n.last_access, n.node_id, n) for n in self.nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        while heap and len(freed) < num_pages:
            _, _, node = heapq.heappop(heap)
            keep = len(node.pages) - (num_pages - len(freed))
            if keep > 0:
                self._split(node, keep)  # node keeps its deepest pages: those go
            parent = node.parent
            del parent.children[node.keys[0]]
            node.parent = None
            self._num_evictable -= len(node.pages)
            freed.extend(self._pool.decref(node.pages))
            self._emit(BlockRemoved(tuple(node.hashes)))
            if parent.is_root:
                if not parent.children:
                    del self._roots[parent.salt]
            elif not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        return freed

    def reset(self) -> bool:
        """Drop every cached page; refuses (returns False, changes nothing) while any node is locked."""
        if self._num_locked:
            return False
        for node in list(self.nodes()):
            self._pool.decref(node.pages)
            node.parent = None  # stale handles now fail lock/unlock instead of touching the new tree
        self._roots.clear()
        self._num_evictable = 0
        self._emit(AllBlocksCleared())
        return True

    def drop_salts(self, matches: Callable[[str | None], bool]) -> bool:
        """Drop every page cached under a salt for which ``matches`` is true (a namespace whose KV is stale);
        refuses (returns False, changes nothing) while any of those pages is locked."""
        roots = [root for salt, root in self._roots.items() if matches(salt)]
        if any(child.lock_ref for root in roots for child in root.children.values()):
            return False
        for root in roots:
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                stack.extend(node.children.values())
                self._num_evictable -= len(node.pages)
                self._pool.decref(node.pages)
                node.parent = None
                self._emit(BlockRemoved(tuple(node.hashes)))
            del self._roots[root.salt]
        return True

    # -- checking --------------------------------------------------------------------------------

    def check_integrity(self, locked_nodes: Iterable[RadixNode] | None = None) -> None:
        """Raise ``IntegrityError`` unless the invariants in the class docstring hold.

        ``locked_nodes`` (one entry per outstanding ``lock`` call) also checks the lock counts exactly.
        """
        direct: dict[int, int] = {}
        if locked_nodes is not None:
            for node in locked_nodes:
                if not self.is_attached(node):
                    raise IntegrityError(f"locked {node} is no longer in the tree")
                direct[node.node_id] = direct.get(node.node_id, 0) + 1
        seen_pages: set[int] = set()
        evictable = locked = 0
        for salt, root in self._roots.items():
            if root.salt != salt or root.pages or root.keys or root.hashes or root.parent is not None:
                raise IntegrityError(f"bad root for salt {salt!r}")
            if not root.children:
                raise IntegrityError(f"empty root kept for salt {salt!r}")  # would grow with every tenant
        for node in self.nodes():
            n = len(node.pages)
            if n == 0 or len(node.keys) != n or len(node.hashes) != n:
                raise IntegrityError(f"{node}: {len(node.keys)} keys, {n} pages, {len(node.hashes)} hashes")
            parent = node.parent
            if parent.children.get(node.keys[0]) is not node or node.salt != parent.salt:
                raise IntegrityError(f"{node} is not filed under its first page in its parent")
            h = parent.hashes[-1] if not parent.is_root else None
            for key, page, node_hash in zip(node.keys, node.pages, node.hashes, strict=True):
                if len(key) != self._page_size:
                    raise IntegrityError(f"{node} caches a partial page {key}")
                h = hash_block(h, key, node.salt)
                if h != node_hash:
                    raise IntegrityError(f"{node}: block hash does not chain")
                if page in seen_pages:
                    raise IntegrityError(f"page {page} cached twice")
                seen_pages.add(page)
                if self._pool.refcount(page) < 1:
                    raise IntegrityError(f"cached page {page} is free in the pool")
            below = sum(child.lock_ref for child in node.children.values())
            if node.lock_ref < below:
                raise IntegrityError(f"{node}: lock_ref below its children's sum {below}")
            if locked_nodes is not None and node.lock_ref != below + direct.get(node.node_id, 0):
                raise IntegrityError(
                    f"{node}: lock_ref {node.lock_ref}, expected {below + direct.get(node.node_id, 0)}"
                )
            if node.last_access < max((c.last_access for c in node.children.values()), default=0):
                raise IntegrityError(f"{node} is older than one of its children")
            if node.lock_ref:
                locked += n
            else:
                evictable += n
        if (evictable, locked) != (self._num_evictable, self._num_locked):
            raise IntegrityError(
                f"page counts: evictable {self._num_evictable} / locked {self._num_locked}, "
                f"tree has {evictable} / {locked}"
            )
