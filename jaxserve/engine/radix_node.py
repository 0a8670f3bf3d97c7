"""The radix cache's tree node and the small named results of its lookups and inserts."""

from __future__ import annotations

from dataclasses import dataclass

PageKey = tuple[int, ...]
"""The token ids of one full page: the unit the tree matches on."""


class RadixNode:
    """A run of one or more consecutive cached pages (an edge of the radix tree).

    ``keys[i]`` are the token ids in ``pages[i]``, ``hashes[i]`` its chained
    block hash. ``lock_ref`` counts the locks on this node and on all its
    descendants. Callers treat nodes as opaque handles for ``lock``/``unlock``.
    """

    __slots__ = (
        "node_id",
        "keys",
        "pages",
        "hashes",
        "children",
        "parent",
        "lock_ref",
        "last_access",
        "salt",
    )

    def __init__(
        self,
        node_id: int,
        keys: list[PageKey],
        pages: list[int],
        hashes: list[int],
        parent: RadixNode | None,
        salt: str | None,
    ) -> None:
        self.node_id = node_id
        self.keys = keys
        self.pages = pages
        self.hashes = hashes
        self.children: dict[PageKey, RadixNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0
        self.salt = salt

    @property
    def is_root(self) -> bool:
        """Roots (one per cache salt) hold no pages and are never evicted."""
        return not self.keys

    def __repr__(self) -> str:
        return f"RadixNode(id={self.node_id}, pages={self.pages}, lock_ref={self.lock_ref})"


@dataclass(frozen=True)
class MatchResult:
    """The longest cached prefix: its pages in order, its length in tokens, and the node it ends at."""

    pages: tuple[int, ...]
    num_tokens: int
    last_node: RadixNode


@dataclass(frozen=True)
class InsertResult:
    """What ``insert`` did with the caller's pages.

    ``pages[i]`` is the page the cache now holds for page ``i`` of the inserted
    tokens (the caller's own page where it was newly stored); ``redundant_pages``
    are the caller's pages that duplicate an already cached page and so were not
    stored; ``num_cached_tokens`` is how many tokens were cached before the call.
    """

    pages: tuple[int, ...]
    redundant_pages: tuple[int, ...]
    num_cached_tokens: int
    last_node: RadixNode
