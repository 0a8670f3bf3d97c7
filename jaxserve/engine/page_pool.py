"""The KV page pool: host-side, reference-counted ownership of a fixed set of pages."""

from __future__ import annotations

import collections
from collections.abc import Iterable

NULL_PAGE = 0
"""Page id reserved for padding: the device writes padded tokens' KV here, so it is never handed out."""


class OutOfPages(RuntimeError):
    """Raised by ``PagePool.allocate`` when fewer pages are free than requested (nothing is allocated)."""

    def __init__(self, requested: int, free: int) -> None:
        super().__init__(f"asked for {requested} KV pages but only {free} are free")
        self.requested = requested
        self.free = free


class IntegrityError(AssertionError):
    """A host-side KV bookkeeping invariant does not hold (a bug, never a user error)."""


def pages_needed(num_tokens: int, page_size: int) -> int:
    """Number of pages that hold ``num_tokens`` tokens."""
    return -(-num_tokens // page_size)


class PagePool:
    """A fixed pool of ``num_pages`` KV pages of ``page_size`` tokens, with reference counts.

    Invariants (``check_integrity`` verifies them):
      - page ``NULL_PAGE`` (0) is never allocated, referenced or freed;
      - every other page is either free (refcount 0, in the free list exactly
        once) or in use (refcount >= 1, not in the free list);
      - a page's refcount equals the number of its owners: each request whose
        page table holds it and each radix-cache node that stores it.

    ``allocate`` hands out pages with refcount 1, ``incref`` adds an owner,
    ``decref`` drops one and returns the page to the free list at zero. Freed
    pages are reused last (FIFO), which makes a stale page id more likely to be
    caught by the cache-content checks in the tests than silently reused.

    Pages never handed out are not listed: they are the ids from a high-water
    mark up, taken in order before any freed page (as a free list of every page
    in order would give them). A pool of millions of pages (a small model's
    share of a large device) so starts at once, and ``check_integrity`` walks
    only the pages handed out so far.
    """

    def __init__(self, num_pages: int, page_size: int = 16) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {page_size}")
        self._num_pages = num_pages
        self._page_size = page_size
        self._refcount = [0] * num_pages
        self._fresh = 1  # pages from here up were never handed out (free, in order)
        self._free: collections.deque[int] = collections.deque()  # pages given back, in the order they were

    @property
    def num_pages(self) -> int:
        """Total pages, the reserved page 0 included."""
        return self._num_pages

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self._page_size

    @property
    def num_usable_pages(self) -> int:
        """Pages that can ever be handed out (all but page 0)."""
        return self._num_pages - 1

    @property
    def num_free(self) -> int:
        """Pages free now."""
        return len(self._free) + self._num_pages - self._fresh

    @property
    def num_used(self) -> int:
        """Pages with at least one owner."""
        return self.num_usable_pages - self.num_free

    @property
    def usage(self) -> float:
        """Fraction of the usable pages in use, in [0, 1]."""
        return self.num_used / self.num_usable_pages

    def refcount(self, page: int) -> int:
        """Number of owners of ``page``."""
        return self._refcount[page]

    def can_allocate(self, n: int) -> bool:
        """Whether ``allocate(n)`` would succeed now."""
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free pages, each with refcount 1; raises ``OutOfPages`` (taking none) if short."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > self.num_free:
            raise OutOfPages(n, self.num_free)
        fresh = min(n, self._num_pages - self._fresh)
        pages = list(range(self._fresh, self._fresh + fresh)) + [self._free.popleft() for _ in range(n - fresh)]
        self._fresh += fresh
        for page in pages:
            self._refcount[page] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """Add one owner to each page (a page listed twice gains two); each must be in use."""
        pages = list(pages)
        for page in pages:
            self._check_in_use(page, 1, "incref")
        for page in pages:
            self._refcount[page] += 1

    def decref(self, pages: Iterable[int]) -> list[int]:
        """Drop one owner from each page; returns the pages that became free, in order."""
        counts = collections.Counter(pages)
        # Validate everything before touching anything, so a double free leaves the pool intact.
        for page, count in counts.items():
            self._check_in_use(page, count, "decref")
        freed = []
        for page, count in counts.items():
            self._refcount[page] -= count
            if self._refcount[page] == 0:
                self._free.append(page)
                freed.append(page)
        return freed

    free = decref

    def _check_in_use(self, page: int, count: int, what: str) -> None:
        if not 0 < page < self._num_pages:
            raise ValueError(f"{what}: page {page} is not a usable page id (1..{self._num_pages - 1})")
        if self._refcount[page] < count:
            raise ValueError(f"{what}: page {page} has refcount {self._refcount[page]}, needs >= {count}")

    def check_integrity(self, owners: Iterable[Iterable[int]]) -> None:
        """Raise ``IntegrityError`` unless refcounts equal the owner counts and free/used partition the pool.

        ``owners`` holds one page list per owner (each request's page table and
        each cache node's pages); a page must not appear twice in one owner. Walks
        the pages handed out so far (those above the high-water mark have never
        had an owner, and none may claim one).
        """
        expected = [0] * self._fresh
        for pages in owners:
            pages = list(pages)
            if len(set(pages)) != len(pages):
                raise IntegrityError(f"an owner holds a page twice: {pages}")
            for page in pages:
                if not 0 < page < self._num_pages:
                    raise IntegrityError(f"owner holds invalid page {page}")
                if page >= self._fresh:
                    raise IntegrityError(f"owner holds page {page}, which was never handed out")
                expected[page] += 1
        free = set(self._free)
        if len(free) != len(self._free):
            raise IntegrityError("a page is in the free list twice")
        if NULL_PAGE in free or self._refcount[NULL_PAGE] != 0:
            raise IntegrityError("the reserved page 0 was handed out or freed")
        if any(page >= self._fresh for page in free):
            raise IntegrityError("the free list holds a page that was never handed out")
        for page in range(1, self._fresh):
            if self._refcount[page] != expected[page]:
                raise IntegrityError(
                    f"page {page}: refcount {self._refcount[page]} but {expected[page]} owners"
                    + (" (leaked)" if expected[page] == 0 else "")
                )
            if (page in free) != (expected[page] == 0):
                state = "free" if page in free else "not free"
                raise IntegrityError(f"page {page} is {state} with {expected[page]} owners")


class StateSlots:
    """A hybrid model's state slots (`engine.hybrid`), one per running request (`Request.state_slot`): taken at
    admission, given back when it stops running (finished, aborted, preempted: it then starts again at position 0)."""

    def __init__(self, num_slots: int):
        self.free = list(range(num_slots - 1, 0, -1))  # (slot 0 is the padding's)

    def take(self, request) -> None:
        if not self.free:
            raise IntegrityError(f"no state slot left for {request.request_id!r}")
        request.state_slot = self.free.pop()

    def give(self, request) -> None:
        if request.state_slot:
            self.free.append(request.state_slot)
            request.state_slot = 0
