"""The pure planner ``schedule(state, config)`` on hand-built snapshots: expected plans, purity, properties."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.engine.page_pool import pages_needed
from jaxserve.engine.schedule import PageAction, RequestView, SchedulerState, schedule
from jaxserve.engine.scheduler_config import SchedulerConfig


def config(**kw):
    defaults = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128, page_size=4)
    defaults.update(kw)
    return SchedulerConfig(**defaults)


def decode(rid, arrival, num_tokens=6, priority=0, num_pages=None, prefix=()):
    """A running request about to feed its last sampled token (position ``num_tokens - 1``)."""
    pages = num_pages if num_pages is not None else pages_needed(num_tokens, 4)
    return RequestView(rid, priority, arrival, num_tokens, 1, num_tokens - 1, pages, tuple(prefix))


def prefill(rid, arrival, num_tokens, computed=0, priority=0, num_pages=None):
    """A running request still computing its prompt."""
    pages = num_pages if num_pages is not None else pages_needed(computed, 4)
    return RequestView(rid, priority, arrival, num_tokens, 0, computed, pages, ())


def waiting(rid, arrival, num_tokens, priority=0, prefix=()):
    return RequestView(rid, priority, arrival, num_tokens, prefix_pages=prefix)


def state(running=(), waiting_=(), free=100, pinned=(), finished=()):
    return SchedulerState(0, tuple(running), tuple(waiting_), free, frozenset(pinned), tuple(finished))


def batch(plan):
    return [(s.request_id, s.num_new_tokens) for s in plan.scheduled]


# -- expected plans --------------------------------------------------------------------------------


def test_chunks_never_end_inside_a_whole_span():
    """`whole_spans` (an image attended both ways): a chunk that would end inside one stops before it; a request
    at a span's start waits for a step whose budget holds the span whole (running: skipped; waiting: admission
    stops there), the last decodes giving way when the span fits the budget but not beside them; a chunk starting
    inside a span (a prefix cache hit into it) runs to its end or waits."""
    spans = ((6, 14),)
    p = prefill("p", 0, 20, computed=0)._replace(whole_spans=spans)
    _, plan = schedule(state(running=[p]), config(max_num_batched_tokens=10))
    assert batch(plan) == [("p", 6)]
    at = prefill("p", 0, 20, computed=6, num_pages=2)._replace(whole_spans=spans)
    _, plan = schedule(state(running=[decode("d", 1), at]), config(max_num_batched_tokens=8))
    assert batch(plan) == [("p", 8)]  # beside the decode 7 tokens are left, 8 needed: the decode gives way
    _, plan = schedule(state(running=[decode("d", 1), decode("e", 2), at]), config(max_num_batched_tokens=9))
    assert batch(plan) == [("d", 1), ("p", 8)]
    _, plan = schedule(state(running=[decode("d", 1), at]), config(max_num_batched_tokens=7))
    assert batch(plan) == [("d", 1)]  # the span does not fit the budget at all: the decodes go on
    _, plan = schedule(state(running=[at]), config(max_num_batched_tokens=8))
    assert batch(plan) == [("p", 8)]
    inside = prefill("p", 0, 20, computed=10, num_pages=3)._replace(whole_spans=spans)
    _, plan = schedule(state(running=[inside]), config(max_num_batched_tokens=3, max_num_seqs=2))
    assert batch(plan) == []
    _, plan = schedule(state(running=[inside]), config(max_num_batched_tokens=5))
    assert batch(plan) == [("p", 5)]
    w = waiting("w", 2, 20, prefix=(1,))._replace(whole_spans=((4, 12),))
    _, plan = schedule(state(waiting_=[w, waiting("x", 3, 2)]), config(max_num_batched_tokens=6))
    assert batch(plan) == []  # from the cached 4 tokens, 6 would end inside the span: admission stops
    _, plan = schedule(state(waiting_=[w]), config(max_num_batched_tokens=10))
    assert batch(plan) == [("w", 10)]


def test_decodes_come_first_then_prefills_then_admissions():
    s = state(
        running=[prefill("p", 0, 10, computed=4), decode("d", 1)],
        waiting_=[waiting("w", 2, 3)],
        finished=("gone",),
    )
    new, plan = schedule(s, config())
    assert batch(plan) == [("d", 1), ("p", 6), ("w", 3)]
    assert [x.is_decode for x in plan.scheduled] == [True, False, False]
    assert [x.start_position for x in plan.scheduled] == [5, 4, 0]
    assert [x.sample for x in plan.scheduled] == [True, True, True]
    # "d" already holds the page for position 5; "p" needs two for positions 4..9, "w" one.
    assert plan.actions == (PageAction("grow", "p", 2), PageAction("admit", "w", 1))
    assert plan.finished_ids == ("gone",) and new.finished_ids == ()
    assert [v.request_id for v in new.running] == ["p", "d", "w"]
    assert new.waiting == () and new.num_free_pages == 100 - 3 and new.step == 1


def test_token_budget_cuts_the_last_prefill():
    s = state(running=[decode("d1", 0), decode("d2", 1), prefill("p", 2, 40)], waiting_=[waiting("w", 3, 2)])
    _, plan = schedule(s, config(max_num_batched_tokens=8))
    assert batch(plan) == [("d1", 1), ("d2", 1), ("p", 6)]
    assert not plan.scheduled[-1].sample  # a chunk short of the prompt's end samples nothing
    assert plan.lookup_id is None  # the budget ran out before admission looked at "w"


def test_long_prefill_threshold_chunks_each_prefill():
    s = state(running=[prefill("a", 0, 20, computed=8, num_pages=2), prefill("b", 1, 20)])
    _, plan = schedule(s, config(long_prefill_token_threshold=5))
    assert batch(plan) == [("a", 5), ("b", 5)]
    assert plan.scheduled[0].start_position == 8


def test_admission_stops_at_the_first_request_that_does_not_fit():
    s = state(
        waiting_=[waiting("small", 0, 4), waiting("big", 1, 12), waiting("after", 2, 4)],
        free=3,  # "small" takes 1 page, "big" needs 3
    )
    new, plan = schedule(s, config())
    assert batch(plan) == [("small", 4)]  # "after" would fit but must not overtake "big"
    assert [v.request_id for v in new.waiting] == ["big", "after"]
    assert new.num_free_pages == 2


def test_admission_respects_max_num_seqs():
    s = state(running=[decode("d", 0)], waiting_=[waiting("a", 1, 2), waiting("b", 2, 2)])
    _, plan = schedule(s, config(max_num_seqs=2, max_num_batched_tokens=16))
    assert batch(plan) == [("d", 1), ("a", 2)]


def test_lora_adapters_beyond_max_loras_wait_and_base_requests_pass_them():
    """At most `max_loras` adapters run; a request of another adapter is passed over, and behind it only
    base-model requests are admitted (a later request of a running adapter waits too, so it cannot starve)."""
    a_running = decode("d", 0)._replace(adapter="A")
    queue = [waiting("b", 1, 2)._replace(adapter="B"), waiting("base", 2, 2), waiting("a", 3, 2)._replace(adapter="A"),
             waiting("base2", 4, 2)]
    new, plan = schedule(state(running=[a_running], waiting_=queue), config(max_num_seqs=8, max_loras=1))
    assert batch(plan) == [("d", 1), ("base", 2), ("base2", 2)]
    assert [v.request_id for v in new.waiting] == ["b", "a"]
    assert [a.kind for a in plan.actions] == ["admit", "admit"]
    # Once "d" has ended, "b" takes the slot and "a" waits behind it.
    looked_up = [v._replace(prefix_pages=()) for v in new.waiting]
    new, plan = schedule(state(waiting_=looked_up), config(max_num_seqs=8, max_loras=1))
    assert batch(plan) == [("b", 2)] and [v.request_id for v in new.waiting] == ["a"]
    # Two adapters fit two slots; the head of the queue is not held back.
    _, plan = schedule(state(running=[a_running], waiting_=queue), config(max_num_seqs=8, max_loras=2))
    assert batch(plan) == [("d", 1), ("b", 2), ("base", 2), ("a", 2), ("base2", 2)]
    # Requests of a running adapter at the head, and no limit, are admitted as any other.
    _, plan = schedule(state(running=[a_running], waiting_=queue[2:]), config(max_num_seqs=8, max_loras=1))
    assert batch(plan) == [("d", 1), ("a", 2), ("base2", 2)]
    _, plan = schedule(state(running=[a_running], waiting_=queue), config(max_num_seqs=8))
    assert len(batch(plan)) == 5
    with pytest.raises(ValueError, match="max_loras must be a positive int or None, got 0"):
        config(max_loras=0)


def test_cached_prefix_costs_its_unshared_pages():
    # "w" reuses pages 7, 8 (only the cache holds them: sharing makes them unevictable) and
    # needs one new page for its last two tokens.
    w = waiting("w", 1, 10, prefix=(7, 8))
    _, plan = schedule(state(waiting_=[w], free=2), config())
    assert batch(plan) == []
    new, plan = schedule(state(waiting_=[w], free=3), config())
    assert plan.actions == (PageAction("admit", "w", num_pages=1, num_cached_tokens=8),)
    assert batch(plan) == [("w", 2)] and plan.scheduled[0].start_position == 8
    assert new.num_free_pages == 0
    # Pages a running request holds already, or pinned ones, are shared for free.
    holder = decode("h", 0, num_tokens=10, num_pages=3, prefix=(7, 8))
    _, plan = schedule(state(running=[holder], waiting_=[w], free=1), config())
    assert batch(plan) == [("h", 1), ("w", 2)]
    _, plan = schedule(state(waiting_=[w], free=1, pinned=(7, 8)), config())
    assert batch(plan) == [("w", 2)]


def test_admission_asks_for_a_prefix_lookup_when_it_reaches_an_unlooked_request():
    s = state(running=[decode("d", 0)], waiting_=[waiting("a", 1, 3), waiting("b", 2, 3, prefix=None)])
    _, plan = schedule(s, config())
    assert plan.lookup_id == "b" and batch(plan) == [("d", 1), ("a", 3)]
    s = dataclasses.replace(s, waiting=(s.waiting[0], s.waiting[1]._replace(prefix_pages=())))
    _, plan = schedule(s, config())
    assert plan.lookup_id is None and batch(plan) == [("d", 1), ("a", 3), ("b", 3)]


@pytest.mark.parametrize(
    "policy,expected_victim",
    [("fcfs", "c"), ("priority", "a")],  # fcfs: the newest; priority: the largest priority value
)
def test_preemption_victim_order(policy, expected_victim):
    # Three decodes at a page boundary (8 tokens computed in 2 pages) each need a page; none is free.
    running = [
        decode(rid, i, num_tokens=9, priority=p, num_pages=2)
        for i, (rid, p) in enumerate([("a", 2), ("b", 0), ("c", 1)])
    ]
    new, plan = schedule(state(running=running, waiting_=[waiting("w", 3, 2)], free=0), config(policy=policy))
    assert plan.preempted_ids == (expected_victim,)
    assert plan.actions[0] == PageAction("preempt", expected_victim)
    assert {s.request_id for s in plan.scheduled} == {"a", "b", "c"} - {expected_victim}
    assert all(a.kind == "grow" and a.num_pages == 1 for a in plan.actions[1:])
    assert "w" not in {s.request_id for s in plan.scheduled}  # no admission after a preemption
    victim = next(v for v in new.waiting if v.request_id == expected_victim)
    assert (victim.num_computed_tokens, victim.num_pages, victim.prefix_pages) == (0, 0, None)
    keys = [config(policy=policy).order_key(v.priority, v.arrival_index) for v in new.waiting]
    assert keys == sorted(keys)
    assert new.num_free_pages == 0  # two pages freed, two taken


def test_preempting_a_scheduled_decode_gives_its_tokens_back():
    low = decode("low", 0, num_tokens=6, priority=5)  # 5 computed in 2 pages: no page needed
    high = prefill("high", 1, 16, computed=8, priority=0, num_pages=2)
    _, plan = schedule(
        state(running=[low, high], free=1), config(max_num_batched_tokens=8, policy="priority")
    )
    assert plan.preempted_ids == ("low",)
    assert batch(plan) == [("high", 8)]  # low's decode token went back to the budget


def test_preemption_frees_only_pages_no_one_else_holds():
    # "x" and "y" share the cached pages 1, 2; "x" alone holds page 3.
    y = prefill("y", 0, 20, computed=8, num_pages=2)
    y = y._replace(prefix_pages=(1, 2))
    x = decode("x", 1, num_tokens=10, num_pages=3, prefix=(1, 2))
    # y's next 8 tokens need 2 pages; preempting x frees just page 3, so y preempts itself too.
    new, plan = schedule(state(running=[y, x], free=0), config(max_num_batched_tokens=8))
    assert plan.preempted_ids == ("x", "y") and plan.scheduled == ()
    assert new.num_free_pages == 3
    # With one page free, preempting x is enough.
    _, plan = schedule(state(running=[y, x], free=1), config(max_num_batched_tokens=8))
    assert plan.preempted_ids == ("x",) and batch(plan) == [("y", 8)]
    # Pages pinned by someone else stay taken.
    new, plan = schedule(state(running=[y, x], free=0, pinned=(1, 2)), config(max_num_batched_tokens=8))
    assert plan.preempted_ids == ("x", "y") and new.num_free_pages == 1


def test_a_cached_prefix_must_leave_a_token_to_compute():
    with pytest.raises(ValueError, match="leave a token"):
        schedule(state(waiting_=[waiting("w", 0, 8, prefix=(1, 2))]), config())


def test_state_is_checked():
    with pytest.raises(ValueError, match="num_free_pages"):
        state(free=-1)
    with pytest.raises(ValueError, match="twice"):
        schedule(state(running=[decode("d", 0), decode("d", 1)]), config())


# -- purity and properties ---------------------------------------------------------------------------


@st.composite
def states(draw):
    ps = draw(st.sampled_from([2, 4]))
    max_num_seqs = draw(st.integers(1, 4))
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=draw(st.integers(max_num_seqs, 16)),
        page_size=ps,
        long_prefill_token_threshold=draw(st.none() | st.integers(1, 8)),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
    )
    chain = list(range(1, 7))  # the cached pages: one chain, so any prefix of it is a valid cached path
    next_private = 100
    num_running = draw(st.integers(0, max_num_seqs))
    num_waiting = draw(st.integers(0, 4))
    arrivals = draw(st.permutations(range(num_running + num_waiting)))
    running, private = [], 0
    for i in range(num_running):
        num_tokens = draw(st.integers(2, 24))
        computed = draw(st.integers(0, num_tokens - 1))
        outputs = draw(st.integers(0, num_tokens - 1)) if computed == num_tokens - 1 else 0
        shared = draw(st.integers(0, min(len(chain), computed // ps)))
        num_pages = max(shared, pages_needed(computed, ps)) + draw(st.integers(0, 1))
        private += num_pages - shared
        next_private += num_pages - shared
        running.append(
            RequestView(
                f"r{i}",
                draw(st.integers(0, 2)),
                arrivals[i],
                num_tokens,
                outputs,
                computed,
                num_pages,
                tuple(chain[:shared]),
            )
        )
    waiting_views = []
    for i in range(num_waiting):
        num_tokens = draw(st.integers(1, 24))
        shared = draw(st.integers(0, min(len(chain), (num_tokens - 1) // ps)))
        prefix = draw(st.none() | st.just(tuple(chain[:shared])))
        waiting_views.append(
            RequestView(
                f"w{i}", draw(st.integers(0, 2)), arrivals[num_running + i], num_tokens, prefix_pages=prefix
            )
        )
    waiting_views.sort(key=lambda v: cfg.order_key(v.priority, v.arrival_index))
    pinned = frozenset(draw(st.sets(st.sampled_from(chain))))
    held = {p for v in running for p in v.prefix_pages} | pinned
    total = len(held) + private + draw(st.integers(0, 8))
    s = SchedulerState(
        draw(st.integers(0, 5)), tuple(running), tuple(waiting_views), total - len(held) - private, pinned
    )
    return cfg, s, total


def pages_in_use(s):
    """Pages the running requests and pins hold (the rest are free)."""
    shared = {p for v in s.running for p in v.prefix_pages} | s.pinned_pages
    return len(shared) + sum(v.num_pages - len(v.prefix_pages) for v in s.running)


@settings(max_examples=400, deadline=None)
@given(states())
def test_plan_respects_the_limits(case):
    cfg, s, total = case
    before = dataclasses.replace(s)
    new, plan = schedule(s, cfg)
    assert s == before  # the input is untouched
    assert schedule(s, cfg) == (new, plan)  # and the answer depends on it alone

    ids = [x.request_id for x in plan.scheduled]
    assert len(ids) == len(set(ids)) <= cfg.max_num_seqs
    assert len(new.running) <= cfg.max_num_seqs
    assert plan.num_batched_tokens <= cfg.max_num_batched_tokens
    flags = [x.is_decode for x in plan.scheduled]
    assert flags == sorted(flags, reverse=True), "a prefill was scheduled before a decode"
    assert not set(plan.preempted_ids) & set(ids)
    by_id = {v.request_id: v for v in new.running}
    for x in plan.scheduled:
        view = by_id[x.request_id]
        assert x.num_new_tokens >= 1 and x.start_position == view.num_computed_tokens
        assert view.num_pages * cfg.page_size >= x.start_position + x.num_new_tokens
        assert x.sample == (x.start_position + x.num_new_tokens == view.num_tokens)
        if not x.is_decode:
            assert x.num_new_tokens <= cfg.prefill_chunk_size
    for v in s.running:  # the budget always covers every decode that was not preempted
        if v.is_decoding and v.request_id not in plan.preempted_ids:
            assert v.request_id in ids
    # Admission takes a head of the waiting queue, in order, and never alongside a preemption.
    admitted = [a.request_id for a in plan.actions if a.kind == "admit"]
    assert admitted == [v.request_id for v in s.waiting[: len(admitted)]]
    assert not (admitted and plan.preempted_ids)
    # Pages are conserved: free + held is the same before and after.
    assert new.num_free_pages >= 0
    assert new.num_free_pages + pages_in_use(new) == total
