"""RadixCache: matching, dedup on insert, locks, LRU eviction, salts, and the KV events it emits."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxserve.engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBuffer,
    hash_block,
    hash_token_pages,
)
from jaxserve.engine.page_pool import PagePool
from jaxserve.engine.radix_cache import RadixCache

PS = 4


def make(num_pages=32):
    pool = PagePool(num_pages, PS)
    cache = RadixCache(pool)
    events = KVEventBuffer()
    cache.subscribe(events)
    return pool, cache, events


def cache_tokens(pool, cache, tokens, salt=None):
    """Compute-and-cache as a request would: allocate, insert, drop the request's references."""
    pages = pool.allocate(len(tokens) // PS)
    result = cache.insert(tokens, pages, salt)
    pool.decref(pages)
    return result


def test_match_returns_longest_full_page_prefix():
    pool, cache, _ = make()
    tokens = list(range(10))  # two full pages and a partial one
    result = cache_tokens(pool, cache, tokens)
    assert len(result.pages) == 2 and result.num_cached_tokens == 0
    assert cache.num_cached_pages == 2 and pool.num_used == 2

    m = cache.match_prefix(list(range(10)) + [99])
    assert m.num_tokens == 8 and m.pages == result.pages
    m = cache.match_prefix([0, 1, 2, 3, 4, 5, 6, 99])  # diverges inside page 2
    assert m.num_tokens == 4 and m.pages == result.pages[:1]
    assert cache.match_prefix([7, 7, 7, 7]).num_tokens == 0
    assert cache.query_tokens == 11 + 8 + 4 and cache.hit_tokens == 8 + 4
    cache.check_integrity(locked_nodes=[])
    pool.check_integrity(cache.owners())


def test_insert_dedups_and_reports_redundant_pages():
    pool, cache, _ = make()
    first = cache_tokens(pool, cache, [1, 2, 3, 4, 5, 6, 7, 8])
    mine = pool.allocate(3)
    result = cache.insert([1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9], mine)
    assert result.num_cached_tokens == 8
    assert result.redundant_pages == tuple(mine[:2])
    assert result.pages == first.pages + (mine[2],)
    # The cache took a reference only on the page it stored; the caller still owns all three.
    assert [pool.refcount(p) for p in mine] == [1, 1, 2]
    assert pool.decref(mine) == mine[:2]
    pool.check_integrity(cache.owners())
    cache.check_integrity()


def test_partial_match_splits_node_and_lock_protects_exactly_the_prefix():
    pool, cache, _ = make()
    cache_tokens(pool, cache, list(range(16)))  # one node of four pages
    m = cache.match_prefix(list(range(8)) + [50] * 8)
    assert m.num_tokens == 8
    cache.lock(m.last_node)
    assert cache.num_locked_pages == 2 and cache.num_evictable_pages == 2
    freed = cache.evict(100)
    assert len(freed) == 2  # only the unlocked tail went
    assert cache.match_prefix(list(range(16))).num_tokens == 8
    cache.check_integrity(locked_nodes=[m.last_node])
    cache.unlock(m.last_node)
    assert len(cache.evict(100)) == 2
    assert pool.num_free == pool.num_usable_pages
    with pytest.raises(ValueError, match="no longer cached"):
        cache.unlock(m.last_node)
    with pytest.raises(ValueError, match="no longer cached"):
        cache.lock(m.last_node)


def test_eviction_trims_the_deepest_pages_of_a_leaf():
    pool, cache, events = make()
    pages = cache_tokens(pool, cache, list(range(16))).pages  # one node of four pages
    events.drain()
    assert cache.evict(1) == [pages[3]]
    assert cache.match_prefix(list(range(16))).pages == pages[:3]
    assert events.drain() == [BlockRemoved((hash_token_pages(list(range(16)), PS)[3],))]
    assert cache.evict(2) == [pages[1], pages[2]]
    cache.check_integrity()
    pool.check_integrity(cache.owners())


def test_locked_ancestors_survive_eviction():
    pool, cache, _ = make()
    cache_tokens(pool, cache, [1] * 8)
    cache_tokens(pool, cache, [1] * 8 + [2] * 4)
    cache_tokens(pool, cache, [1] * 8 + [3] * 4)
    leaf = cache.match_prefix([1] * 8 + [2] * 4).last_node
    cache.lock(leaf)
    cache.evict(100)
    # The sibling branch went; the locked leaf and its shared parent stayed.
    assert cache.match_prefix([1] * 8 + [3] * 4).num_tokens == 8
    assert cache.match_prefix([1] * 8 + [2] * 4).num_tokens == 12
    cache.check_integrity(locked_nodes=[leaf])


def test_eviction_is_least_recently_used_first():
    pool, cache, events = make()
    a = cache_tokens(pool, cache, [1] * 4).pages
    b = cache_tokens(pool, cache, [2] * 4).pages
    c = cache_tokens(pool, cache, [3] * 4).pages
    cache.match_prefix([1] * 4)  # a is now the most recent
    assert cache.evict(1) == list(b)
    assert cache.evict(1) == list(c)
    assert cache.evict(1) == list(a)
    assert cache.evict(1) == []
    removed = [e for e in events.drain() if isinstance(e, BlockRemoved)]
    assert [e.block_hashes for e in removed] == [
        (hash_block(None, [2] * 4),),
        (hash_block(None, [3] * 4),),
        (hash_block(None, [1] * 4),),
    ]


def test_eviction_removes_children_before_parents():
    pool, cache, _ = make()
    cache_tokens(pool, cache, [1] * 4)
    cache_tokens(pool, cache, [1] * 4 + [2] * 4)
    cache.match_prefix([1] * 4)  # parent touched after the child...
    # ...but only leaves are evictable, so the child goes first anyway.
    child_page = cache.match_prefix([1] * 4 + [2] * 4, record=False).pages[1]
    assert cache.evict(1) == [child_page]


def test_salts_isolate_tenants():
    pool, cache, _ = make()
    tokens = list(range(8))
    cache_tokens(pool, cache, tokens, salt="tenant-a")
    assert cache.match_prefix(tokens + [0], salt="tenant-b").num_tokens == 0
    assert cache.match_prefix(tokens + [0]).num_tokens == 0
    assert cache.match_prefix(tokens + [0], salt="tenant-a").num_tokens == 8
    other = cache_tokens(pool, cache, tokens, salt="tenant-b")
    assert other.num_cached_tokens == 0 and not other.redundant_pages
    assert cache.num_cached_pages == 4
    hashes = cache.block_hashes()
    assert len(set(hashes)) == 4  # same tokens, different salt: different block hashes
    cache.check_integrity()


def test_events_carry_chained_hashes():
    pool, cache, events = make()
    tokens = list(range(12))
    cache_tokens(pool, cache, tokens[:8], salt="s")
    cache_tokens(pool, cache, tokens, salt="s")
    stored = events.drain()
    h0 = hash_block(None, tokens[0:4], "s")
    h1 = hash_block(h0, tokens[4:8], "s")
    h2 = hash_block(h1, tokens[8:12], "s")
    assert stored == [
        BlockStored((h0, h1), None, tuple(tokens[:8]), PS),
        BlockStored((h2,), h1, tuple(tokens[8:12]), PS),
    ]
    assert hash_token_pages(tokens + [0, 0], PS, "s") == [h0, h1, h2]
    assert hash_token_pages(tokens[4:], PS, "s", parent_hash=h0) == [h1, h2]
    assert hash_block(None, tokens[0:4], None) != h0
    # Hash values are fixed by the encoding (SHA-256), not by the process: pin one.
    assert hash_block(None, [1, 2, 3, 4]) == hash_block(None, (1, 2, 3, 4))
    assert hash_block(None, [1, 2, 3, 4]) == 0xD592F41FF24AA3C5
    assert cache.reset()
    assert events.drain() == [AllBlocksCleared()]
    assert pool.num_free == pool.num_usable_pages and cache.num_cached_pages == 0


def test_reset_refuses_while_locked():
    pool, cache, events = make()
    cache_tokens(pool, cache, [5] * 8)
    node = cache.match_prefix([5] * 8).last_node
    cache.lock(node)
    events.drain()
    assert not cache.reset()
    assert cache.num_cached_pages == 2 and len(events) == 0
    cache.unlock(node)
    assert cache.reset()
    assert not cache.is_attached(node)


def test_drop_salts_removes_a_namespace_and_only_it():
    pool, cache, events = make()
    cache_tokens(pool, cache, list(range(8)), salt="a")
    cache_tokens(pool, cache, list(range(12)), salt="a")  # a child node under the first
    cache_tokens(pool, cache, list(range(8)), salt="a|x")
    kept = cache_tokens(pool, cache, list(range(8)), salt="b")
    events.drain()
    node = cache.match_prefix(list(range(8)) + [0], salt="a|x").last_node
    cache.lock(node)
    assert not cache.drop_salts(lambda s: s in ("a", "a|x"))  # a locked page: nothing changes
    assert cache.num_cached_pages == 7 and len(events) == 0
    cache.unlock(node)
    assert cache.drop_salts(lambda s: s in ("a", "a|x"))
    removed = {h for e in events.drain() for h in e.block_hashes}
    assert removed == set(hash_token_pages(list(range(12)), PS, "a")) | set(hash_token_pages(list(range(8)), PS, "a|x"))
    assert cache.match_prefix(list(range(9)), salt="a").num_tokens == 0 and not cache.is_attached(node)
    assert cache.match_prefix(list(range(9)), salt="b").pages == kept.pages
    assert pool.num_used == 2 and cache.num_evictable_pages == 2
    cache.check_integrity(locked_nodes=[])
    pool.check_integrity(cache.owners())


def test_event_buffer_bounds_memory():
    buf = KVEventBuffer(max_events=2)
    for i in range(3):
        buf(BlockRemoved((i,)))
    assert buf.num_dropped == 1
    assert buf.drain() == [BlockRemoved((1,)), BlockRemoved((2,))]


class CacheMachine(RuleBasedStateMachine):
    """Random inserts, lookups, locks and evictions from a small vocabulary (so prefixes collide)."""

    def __init__(self):
        super().__init__()
        self.pool = PagePool(24, PS)
        self.cache = RadixCache(self.pool)
        self.live: dict[int, int] = {}  # block hash -> count, replayed from the events
        self.cache.subscribe(self.on_event)
        self.locks = []  # (node, pages on its path when locked)

    def on_event(self, event):
        if isinstance(event, BlockStored):
            assert event.parent_block_hash is None or event.parent_block_hash in self.live
            assert len(event.token_ids) == len(event.block_hashes) * PS
            for h in event.block_hashes:
                self.live[h] = self.live.get(h, 0) + 1
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                assert self.live.get(h, 0) > 0
                self.live[h] -= 1
                if not self.live[h]:
                    del self.live[h]
        else:
            self.live.clear()

    tokens = st.lists(st.integers(0, 2), min_size=0, max_size=20)
    salts = st.sampled_from([None, "x"])

    @rule(tokens=tokens, salt=salts)
    def insert(self, tokens, salt):
        n = len(tokens) // PS
        if not self.pool.can_allocate(n):
            self.cache.evict(n - self.pool.num_free)
        if not self.pool.can_allocate(n):
            return
        pages = self.pool.allocate(n)
        result = self.cache.insert(tokens, pages, salt)
        # Fresh pages cannot be cached yet: the first k come from the tree, the rest are ours.
        k = result.num_cached_tokens // PS
        assert len(result.pages) == n
        assert not set(result.pages[:k]) & set(pages)
        assert result.pages[k:] == tuple(pages[k:])
        assert result.redundant_pages == tuple(pages[:k])
        self.pool.decref(pages)
        assert self.cache.match_prefix(tokens, salt, record=False).pages == result.pages

    @rule(tokens=tokens, salt=salts)
    def lock(self, tokens, salt):
        m = self.cache.match_prefix(tokens, salt)
        assert m.num_tokens == len(m.pages) * PS <= len(tokens)
        if m.num_tokens:
            self.cache.lock(m.last_node)
            self.locks.append((m.last_node, m.pages))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 100))
    def unlock(self, i):
        node, _ = self.locks.pop(i % len(self.locks))
        self.cache.unlock(node)

    @rule(n=st.integers(0, 8))
    def evict(self, n):
        evictable = self.cache.num_evictable_pages
        free = self.pool.num_free
        freed = self.cache.evict(n)
        assert len(freed) == min(n, evictable)  # every unlocked page is held by the cache alone here
        assert self.pool.num_free == free + len(freed)

    @rule()
    def reset(self):
        if self.cache.reset():
            assert not self.locks and self.pool.num_used == 0

    @invariant()
    def consistent(self):
        self.cache.check_integrity(locked_nodes=[node for node, _ in self.locks])
        self.pool.check_integrity(self.cache.owners())
        for node, pages in self.locks:
            assert self.cache.path_pages(node) == list(pages)
        assert all(count == 1 for count in self.live.values())
        assert sorted(self.live) == sorted(self.cache.block_hashes())
        assert self.cache.num_cached_pages == self.pool.num_used


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
