"""PagePool: allocation, reference counts, and the integrity check itself."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxserve.engine.page_pool import NULL_PAGE, IntegrityError, OutOfPages, PagePool, pages_needed


def test_page_zero_is_never_handed_out():
    pool = PagePool(num_pages=5, page_size=4)
    pages = pool.allocate(4)
    assert sorted(pages) == [1, 2, 3, 4]
    assert NULL_PAGE not in pages
    assert pool.num_free == 0 and pool.usage == 1.0
    with pytest.raises(ValueError):
        pool.incref([NULL_PAGE])
    with pytest.raises(ValueError):
        pool.decref([NULL_PAGE])


def test_out_of_pages_allocates_nothing():
    pool = PagePool(num_pages=4, page_size=16)
    pool.allocate(2)
    with pytest.raises(OutOfPages) as err:
        pool.allocate(2)
    assert err.value.requested == 2 and err.value.free == 1
    assert pool.num_free == 1
    assert pool.can_allocate(1) and not pool.can_allocate(2)


def test_refcounts_free_at_zero():
    pool = PagePool(num_pages=4, page_size=16)
    (page,) = pool.allocate(1)
    pool.incref([page])
    assert pool.refcount(page) == 2
    assert pool.decref([page]) == []
    assert pool.num_free == 2
    assert pool.decref([page]) == [page]
    assert pool.num_free == 3 and pool.usage == 0.0


def test_double_free_is_refused_and_leaves_pool_intact():
    pool = PagePool(num_pages=4, page_size=16)
    a, b = pool.allocate(2)
    with pytest.raises(ValueError, match="refcount"):
        pool.decref([a, b, b])
    assert pool.refcount(a) == 1 and pool.refcount(b) == 1
    pool.decref([a, b])
    with pytest.raises(ValueError):
        pool.decref([a])
    with pytest.raises(ValueError):
        pool.incref([a])


def test_freed_pages_are_reused_last():
    pool = PagePool(num_pages=4, page_size=16)
    (a,) = pool.allocate(1)
    pool.decref([a])
    assert a not in pool.allocate(2)


def test_check_integrity_catches_leaks_and_miscounts():
    pool = PagePool(num_pages=6, page_size=16)
    a, b = pool.allocate(2)
    pool.check_integrity([[a], [b]])
    with pytest.raises(IntegrityError, match="leaked"):
        pool.check_integrity([[a]])
    with pytest.raises(IntegrityError):
        pool.check_integrity([[a], [b], [b]])  # b counted twice, refcount 1
    with pytest.raises(IntegrityError, match="twice"):
        pool.check_integrity([[a, a], [b]])
    c = pool.allocate(1)[0]
    with pytest.raises(IntegrityError):
        pool.check_integrity([[a], [b], [c], [5 if c != 5 else 4]])  # a free page claimed


def test_config_validation():
    with pytest.raises(ValueError):
        PagePool(num_pages=1)
    with pytest.raises(ValueError):
        PagePool(num_pages=8, page_size=12)
    assert pages_needed(0, 16) == 0 and pages_needed(16, 16) == 1 and pages_needed(17, 16) == 2


class PoolMachine(RuleBasedStateMachine):
    """Random allocate/share/release against a model of who owns what."""

    def __init__(self):
        super().__init__()
        self.pool = PagePool(num_pages=9, page_size=4)
        self.owners: list[list[int]] = []

    @rule(n=st.integers(0, 5))
    def allocate(self, n):
        free = self.pool.num_free
        if n > free:
            with pytest.raises(OutOfPages):
                self.pool.allocate(n)
            assert self.pool.num_free == free
        else:
            pages = self.pool.allocate(n)
            assert len(set(pages)) == n and self.pool.num_free == free - n
            self.owners.append(pages)

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def share(self, data):
        source = data.draw(st.sampled_from(self.owners))
        pages = data.draw(st.lists(st.sampled_from(source), unique=True)) if source else []
        self.pool.incref(pages)
        self.owners.append(pages)

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def release(self, data):
        i = data.draw(st.integers(0, len(self.owners) - 1))
        pages = self.owners.pop(i)
        freed = self.pool.decref(pages)
        still_owned = {p for owner in self.owners for p in owner}
        assert set(freed) == set(pages) - still_owned

    @invariant()
    def consistent(self):
        self.pool.check_integrity(self.owners)
        owned = {p for owner in self.owners for p in owner}
        assert self.pool.num_used == len(owned)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_a_pool_of_millions_of_pages_starts_and_checks_what_it_handed_out():
    """Pages never handed out are the ids from a high-water mark up, taken in order before any page given back
    (as a free list of every page would hand them out), and no owner may claim one."""
    pool = PagePool(num_pages=8_000_000, page_size=8)
    assert pool.num_free == 7_999_999 and pool.allocate(3) == [1, 2, 3]
    pool.decref([2])
    assert pool.allocate(2) == [4, 5] and pool.num_free == 7_999_995
    pool.check_integrity([[1], [3], [4, 5]])
    with pytest.raises(IntegrityError, match="page 7, which was never handed out"):
        pool.check_integrity([[1], [3], [4, 5], [7]])
    small = PagePool(num_pages=4, page_size=8)
    assert small.allocate(3) == [1, 2, 3]
    small.decref([3])
    small.decref([1])
    assert small.allocate(2) == [3, 1]  # given back in that order, nothing fresh left
