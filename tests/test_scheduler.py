"""Scheduler: policy examples, and random workloads on small pools checked after every step.

A fake model stands in for the device: it "writes" each fed token's KV as an
id of (cache salt, the whole token prefix up to that position) into the page
slots of the page table, checks that every position a step attends to holds
exactly this request's prefix, and samples tokens from a fixed function of
(request, position), so the expected output of every request is known.
"""

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from jaxserve.engine.kv_events import BlockRemoved, BlockStored, KVEventBuffer, hash_token_pages
from jaxserve.engine.page_pool import NULL_PAGE
from jaxserve.engine.request import Request, RequestStatus
from jaxserve.engine.scheduler import Scheduler, SchedulerConfig

STOP = 0


def token_at(request_id: str, position: int, vocab: int = 5) -> int:
    """The fake model's sample for the token following ``position``; STOP ends the request."""
    return (sum(map(ord, request_id)) * 7 + position * 3) % vocab


def expected_output(request: Request, max_model_len: int, vocab: int) -> list[int]:
    out = []
    while len(out) < request.max_tokens and request.num_prompt_tokens + len(out) < max_model_len:
        tok = token_at(request.request_id, request.num_prompt_tokens + len(out) - 1, vocab)
        out.append(tok)
        if tok == STOP:
            break
    return out


class FakeModel:
    """Checks KV reads and writes against the page tables; samples deterministically."""

    def __init__(self, scheduler: Scheduler, vocab: int = 1000):
        self.s = scheduler
        self.vocab = vocab
        self.ps = scheduler.config.page_size
        self.kv: dict[tuple[int, int], int] = {}  # (page, slot) -> prefix id
        self._prefix_ids: dict[tuple, int] = {}

    def _prefix_id(self, salt, parent: int, token: int) -> int:
        return self._prefix_ids.setdefault((salt, parent, token), len(self._prefix_ids))

    def _slot(self, page_table, pos):
        return page_table[pos // self.ps], pos % self.ps

    def step(self, output, decode_steps: int = 1) -> tuple[dict[str, list[int]], set[str]]:
        sampled, stopped = {}, set()
        for s in output.scheduled:
            req = self.s.get_request(s.request_id)
            tokens = req.all_token_ids
            steps = 1
            if decode_steps > 1 and s.is_decode:
                steps = self.s.reserve_decode_pages(s.request_id, decode_steps)
                assert steps >= 1
            page_table = req.pages  # the reservation may have extended it
            assert list(s.page_table) == page_table[: len(s.page_table)]
            assert NULL_PAGE not in page_table
            ids, parent = [], -1
            for t in tokens:
                parent = self._prefix_id(req.cache_salt, parent, t)
                ids.append(parent)
            for pos in range(s.start_position):  # what attention reads: the cached / computed prefix
                assert self.kv.get(self._slot(page_table, pos)) == ids[pos], (s.request_id, pos)
            assert list(s.token_ids) == tokens[s.start_position : s.start_position + s.num_new_tokens]
            for pos in range(s.start_position, s.start_position + s.num_new_tokens):
                self._write(page_table, pos, ids[pos])
            if not s.sample:
                continue
            new, pos = [], s.start_position + s.num_new_tokens - 1
            for i in range(steps):
                if i:  # a later decode step feeds the token the previous one sampled
                    pos += 1
                    parent = self._prefix_id(req.cache_salt, parent, new[-1])
                    self._write(page_table, pos, parent)
                tok = token_at(s.request_id, pos, self.vocab)
                new.append(tok)
                if tok == STOP:
                    stopped.add(s.request_id)
                    break
            sampled[s.request_id] = new
        return sampled, stopped

    def _write(self, page_table, pos, prefix_id):
        page, slot = self._slot(page_table, pos)
        # Only pages the request holds alone may be written: a shared (cached) page is read-only.
        assert self.s.pool.refcount(page) == 1, f"write into shared page {page}"
        self.kv[(page, slot)] = prefix_id


def run_step(sched, model, decode_steps=1):
    out = sched.schedule()
    sampled, stopped = model.step(out, decode_steps)
    finished = sched.update_after_step(out, sampled, stopped)
    return out, finished


def run_to_completion(sched, model, max_steps=500):
    outputs, finished = [], []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outputs, finished
        out, done = run_step(sched, model)
        sched.check_integrity()
        outputs.append(out)
        finished += done
    raise AssertionError("requests did not finish")


def config(**kw):
    defaults = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, page_size=4)
    defaults.update(kw)
    return SchedulerConfig(**defaults)


# -- examples -------------------------------------------------------------------------------------


def test_config_validation():
    with pytest.raises(ValueError, match="power of two"):
        config(page_size=6)
    with pytest.raises(ValueError, match="max_num_seqs"):
        config(max_num_seqs=8, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="policy"):
        config(policy="lifo")
    with pytest.raises(ValueError):
        config(long_prefill_token_threshold=0)
    with pytest.raises(ValueError):
        config(max_model_len=0)
    assert config(long_prefill_token_threshold=8).prefill_chunk_size == 8
    assert config().prefill_chunk_size == 64


def test_add_request_rejects_what_can_never_run():
    sched = Scheduler(config(max_model_len=32), num_pages=5)  # 4 usable pages = 16 tokens
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(Request("long", [1] * 32, max_tokens=1))
    with pytest.raises(ValueError, match="KV pages"):
        sched.add_request(Request("big", [1] * 10, max_tokens=8))  # 17 tokens of KV
    sched.add_request(Request("ok", [1] * 10, max_tokens=7))  # 16 tokens of KV
    with pytest.raises(ValueError, match="already"):
        sched.add_request(Request("ok", [1], max_tokens=1))
    with pytest.raises(ValueError):
        Request("empty", [], max_tokens=1)


@pytest.mark.parametrize("prompt_len", [20, 21, 3])
def test_prefix_hit_reuses_pages(prompt_len):
    sched = Scheduler(config(), num_pages=64)
    model = FakeModel(sched)
    prompt = [(i * 5) % 7 + 1 for i in range(prompt_len)]
    sched.add_request(Request("a", prompt, max_tokens=3))
    run_to_completion(sched, model)

    sched.add_request(Request("b", prompt, max_tokens=3))
    out = sched.schedule()
    (s,) = out.scheduled
    expected_hit = (prompt_len - 1) // 4 * 4
    req = sched.get_request("b")
    assert req.num_cached_tokens == expected_hit
    assert s.start_position == expected_hit and s.num_new_tokens == prompt_len - expected_hit
    assert s.sample  # at least one token left to compute, so the model yields logits
    assert sched.cache.hit_tokens == expected_hit and sched.cache.query_tokens == 2 * prompt_len
    sampled, stopped = model.step(out)  # asserts the reused pages hold request b's prefix
    sched.update_after_step(out, sampled, stopped)
    run_to_completion(sched, model)
    sched.check_integrity()


def test_concurrent_requests_share_a_prefix_once_prefill_completes():
    sched = Scheduler(config(), num_pages=64)
    model = FakeModel(sched)
    prompt = list(range(1, 18))  # 4 full pages + 1
    sched.add_request(Request("a", prompt, max_tokens=50))
    run_step(sched, model)  # a's prefill completes; its full pages enter the cache
    sched.add_request(Request("b", prompt + [9, 9], max_tokens=2))
    out, _ = run_step(sched, model)
    b = sched.get_request("b")
    a = sched.get_request("a")
    assert b.num_cached_tokens == 16
    assert b.pages[:4] == a.pages[:4]
    assert [sched.pool.refcount(p) for p in a.pages[:4]] == [3] * 4  # a, b and the cache
    sched.check_integrity()


def test_duplicate_prefill_pages_are_swapped_for_the_cached_ones():
    sched = Scheduler(config(), num_pages=64)
    model = FakeModel(sched)
    prompt = list(range(1, 14))
    sched.add_request(Request("a", prompt, max_tokens=20))
    sched.add_request(Request("b", prompt, max_tokens=20))  # same step: no hit for b
    run_step(sched, model)
    a, b = sched.get_request("a"), sched.get_request("b")
    assert a.num_cached_tokens == b.num_cached_tokens == 0
    assert a.pages[:3] == b.pages[:3]  # b's copies were freed in favour of a's cached pages
    assert a.pages[3] != b.pages[3]  # the partial page stays private
    assert sched.pool.num_used == 3 + 2  # three shared full pages, one private partial page each
    run_to_completion(sched, model)


def test_salt_isolation():
    sched = Scheduler(config(), num_pages=64)
    model = FakeModel(sched)
    prompt = list(range(1, 14))
    sched.add_request(Request("a", prompt, max_tokens=2, cache_salt="tenant-1"))
    run_to_completion(sched, model)
    sched.add_request(Request("b", prompt, max_tokens=2, cache_salt="tenant-2"))
    sched.add_request(Request("c", prompt, max_tokens=2))
    sched.add_request(Request("d", prompt, max_tokens=2, cache_salt="tenant-1"))
    sched.schedule()
    assert [sched.get_request(r).num_cached_tokens for r in "bcd"] == [0, 0, 12]


def test_kv_events_from_a_finished_request():
    sched = Scheduler(config(), num_pages=64)
    events = KVEventBuffer()
    sched.cache.subscribe(events)
    model = FakeModel(sched)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5]
    sched.add_request(Request("a", prompt, max_tokens=30, cache_salt="s"))
    _, finished = run_to_completion(sched, model)
    (a,) = finished
    stored = [e for e in events.drain() if isinstance(e, BlockStored)]
    hashes = [h for e in stored for h in e.block_hashes]
    tokens = [t for e in stored for t in e.token_ids]
    computed = a.all_token_ids[: a.num_computed_tokens]
    assert hashes == hash_token_pages(computed, 4, "s")
    assert tokens == computed[: len(computed) // 4 * 4]
    assert stored[0].parent_block_hash is None
    for prev, cur in zip(stored, stored[1:], strict=False):
        assert cur.parent_block_hash == prev.block_hashes[-1]
    assert sorted(sched.cache.block_hashes()) == sorted(hashes)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_admission_order(policy):
    sched = Scheduler(config(max_num_seqs=1, max_num_batched_tokens=8, policy=policy), num_pages=64)
    model = FakeModel(sched)
    for rid, prio in [("low", 5), ("high", 0), ("mid", 1), ("high2", 0)]:
        sched.add_request(Request(rid, [7, 7, 7], max_tokens=1, priority=prio))
    order = [out.scheduled[0].request_id for out in run_to_completion(sched, model)[0]]
    if policy == "priority":
        assert order == ["high", "high2", "mid", "low"]
    else:
        assert order == ["low", "high", "mid", "high2"]


def preemption_scenario(policy):
    """Two decoding requests on a pool too small for both to finish together."""
    sched = Scheduler(config(policy=policy), num_pages=7)  # 6 usable pages = 24 tokens
    model = FakeModel(sched, vocab=1000)  # STOP almost never sampled
    # "old" arrives first with the larger priority value (less important).
    sched.add_request(Request("old", [1] * 8, max_tokens=12, priority=1))
    sched.add_request(Request("new", [2] * 8, max_tokens=12, priority=0))
    outputs, finished = run_to_completion(sched, model)
    preempted = [rid for out in outputs for rid in out.preempted_ids]
    return sched, model, preempted, finished


@pytest.mark.parametrize("policy,victim", [("fcfs", "new"), ("priority", "old")])
def test_preemption_picks_lowest_priority_then_newest(policy, victim):
    sched, model, preempted, finished = preemption_scenario(policy)
    assert preempted and set(preempted) == {victim}
    by_id = {r.request_id: r for r in finished}
    assert by_id[victim].num_preemptions >= 1
    for r in finished:
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == expected_output(r, 128, 1000)  # nothing lost or doubled by recompute
    assert sched.cache.reset() and sched.pool.num_free == sched.pool.num_usable_pages


def test_preempted_request_recomputes_from_the_cache():
    sched = Scheduler(config(), num_pages=7)  # 6 usable pages
    model = FakeModel(sched)
    sched.add_request(Request("old", [1] * 8, max_tokens=8))
    sched.add_request(Request("new", [2] * 8, max_tokens=12))
    outputs, finished = run_to_completion(sched, model)
    (preempt_step,) = [i for i, out in enumerate(outputs) if out.preempted_ids == ("new",)]
    # "new" had 12 tokens of KV (3 pages) when preempted; "old" took the deepest one, the rest stayed cached.
    resumed = next(s for out in outputs[preempt_step + 1 :] for s in out.scheduled if s.request_id == "new")
    assert resumed.start_position == 8
    by_id = {r.request_id: r for r in finished}
    assert by_id["new"].output_token_ids == expected_output(by_id["new"], 128, model.vocab)
    assert by_id["new"].num_cached_tokens == 0  # reported for the first admission only


def test_preempting_a_scheduled_decode_returns_its_budget():
    cfg = config(max_num_seqs=2, max_num_batched_tokens=8, policy="priority", enable_prefix_caching=False)
    sched = Scheduler(cfg, num_pages=5)  # 4 usable pages
    model = FakeModel(sched)
    sched.add_request(Request("low", [1, 1, 1, 1], max_tokens=12, priority=5))
    run_step(sched, model)
    sched.add_request(Request("high", list(range(1, 17)), max_tokens=1, priority=0))
    out, _ = run_step(sched, model)
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("low", 1), ("high", 7)]
    # "low" is scheduled first (decodes go first), then "high" needs its 3rd and 4th pages:
    # "low" is preempted and its decode token goes back to "high".
    out, _ = run_step(sched, model)
    assert out.preempted_ids == ("low",)
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("high", 8)]
    _, finished = run_to_completion(sched, model)
    assert {r.request_id for r in finished} == {"low", "high"}


def test_chunked_prefill_interleaves_with_decodes():
    sched = Scheduler(config(max_num_batched_tokens=16, long_prefill_token_threshold=8), num_pages=64)
    model = FakeModel(sched, vocab=1000)
    sched.add_request(Request("short", [1, 2, 3], max_tokens=10))
    run_step(sched, model)
    sched.add_request(Request("long", list(range(100, 140)), max_tokens=2))
    chunks = []
    while sched.get_request("long").output_token_ids == []:
        out, _ = run_step(sched, model)
        first, second = out.scheduled
        assert first.request_id == "short" and first.is_decode and first.num_new_tokens == 1
        assert second.request_id == "long" and not second.is_decode
        chunks.append((second.start_position, second.num_new_tokens, second.sample))
    assert chunks == [(0, 8, False), (8, 8, False), (16, 8, False), (24, 8, False), (32, 8, True)]


def test_long_prompt_is_chunked_by_the_token_budget():
    sched = Scheduler(config(max_num_seqs=2, max_num_batched_tokens=10), num_pages=64)
    model = FakeModel(sched, vocab=1000)
    sched.add_request(Request("a", list(range(1, 26)), max_tokens=1))
    sizes = [o.scheduled[0].num_new_tokens for o in run_to_completion(sched, model)[0]]
    assert sizes == [10, 10, 5]


def test_abort_frees_everything_at_any_time():
    sched = Scheduler(config(max_num_batched_tokens=8, long_prefill_token_threshold=4), num_pages=64)
    model = FakeModel(sched)
    sched.add_request(Request("mid-prefill", list(range(1, 20)), max_tokens=5))
    sched.add_request(Request("waiting", [1, 2], max_tokens=5))
    run_step(sched, model)
    assert sched.get_request("mid-prefill").num_computed_tokens == 4
    assert sched.abort("mid-prefill") and sched.abort("waiting")
    assert not sched.abort("waiting") and not sched.abort("unknown")
    assert not sched.has_unfinished_requests()
    sched.check_integrity()
    assert sched.pool.num_used == sched.cache.num_cached_pages == 1  # its one computed full page
    out = sched.schedule()
    assert out.is_empty and set(out.finished_ids) == {"mid-prefill", "waiting"}
    assert sched.schedule().finished_ids == ()


def test_abort_between_schedule_and_update():
    sched = Scheduler(config(), num_pages=64)
    model = FakeModel(sched)
    sched.add_request(Request("a", [1, 2, 3], max_tokens=5))
    out = sched.schedule()
    sampled, stopped = model.step(out)
    sched.abort("a")
    assert sched.update_after_step(out, sampled, stopped) == []
    sched.check_integrity()
    assert sched.pool.num_used == 0


def test_stale_or_malformed_updates_are_refused():
    sched = Scheduler(config(), num_pages=64)
    model = FakeModel(sched)
    sched.add_request(Request("a", [1, 2, 3], max_tokens=5))
    out = sched.schedule()
    sampled, stopped = model.step(out)
    with pytest.raises(ValueError, match="no token"):
        sched.update_after_step(out, {}, ())
    sched.update_after_step(out, sampled, stopped)
    with pytest.raises(ValueError, match="stale"):
        sched.update_after_step(out, sampled, stopped)


def test_multi_step_decode_reservation():
    sched = Scheduler(config(), num_pages=64)
    sched.add_request(Request("a", [1, 2, 3, 4, 5], max_tokens=9))
    out = sched.schedule()
    sched.update_after_step(out, {"a": [11]})  # prefill: 5 tokens of KV in 2 pages
    out = sched.schedule()
    # Four decode steps would write KV through position 8, past the two pages held.
    with pytest.raises(ValueError, match="reserve_decode_pages"):
        sched.update_after_step(out, {"a": [11] * 4})
    assert sched.reserve_decode_pages("a", 100) == 8  # capped by the 8 tokens max_tokens still allows
    assert len(sched.get_request("a").pages) == 4  # positions 5..12
    sched.update_after_step(out, {"a": [12] * 3})  # a device loop ran three decode steps
    a = sched.get_request("a")
    assert a.num_output_tokens == 4 and a.num_computed_tokens == 8
    sched.check_integrity()
    out = sched.schedule()
    (finished,) = sched.update_after_step(out, {"a": [13] * 9})  # tokens past max_tokens are dropped
    assert finished.status is RequestStatus.FINISHED_LENGTH
    assert finished.output_token_ids == [11, 12, 12, 12] + [13] * 5
    assert sched.pool.num_used == sched.cache.num_cached_pages == 3  # 12 of 13 computed tokens


def test_schedule_is_deterministic():
    def trace():
        sched = Scheduler(config(max_num_seqs=3, max_num_batched_tokens=12, policy="priority"), num_pages=12)
        model = FakeModel(sched)
        for i in range(6):
            sched.add_request(Request(f"r{i}", [i % 3 + 1] * (5 + 3 * i), max_tokens=6, priority=i % 2))
        return run_to_completion(sched, model)[0]

    assert trace() == trace()


# -- random workloads -----------------------------------------------------------------------------

BASES = [[1, 2, 3, 4, 1, 2, 3, 4, 5, 6], [4, 4, 4, 4, 3, 3], []]


@st.composite
def workloads(draw):
    ps = draw(st.sampled_from([2, 4]))
    max_num_seqs = draw(st.integers(1, 5))
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=draw(st.integers(max_num_seqs, 24)),
        max_model_len=draw(st.sampled_from([24, 64])),
        page_size=ps,
        long_prefill_token_threshold=draw(st.none() | st.integers(1, 12)),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        enable_prefix_caching=draw(st.booleans()),
        max_loras=draw(st.none() | st.integers(1, 2)),
    )
    num_pages = draw(st.integers(4, 16))
    adapters = [None, None] + (["a", "b", "c"] if cfg.max_loras else [])
    requests = []
    for i in range(draw(st.integers(1, 12))):
        prompt = draw(st.sampled_from(BASES)) + draw(st.lists(st.integers(1, 4), max_size=14))
        requests.append(
            dict(
                arrive=draw(st.integers(0, 6)),
                request=Request(
                    f"r{i}",
                    prompt or [1],
                    max_tokens=draw(st.integers(1, 16)),
                    priority=draw(st.integers(0, 2)),
                    cache_salt=draw(st.sampled_from([None, None, "t"])),
                    lora_name=draw(st.sampled_from(adapters)),
                ),
                abort_at=draw(st.none() | st.integers(0, 30)),
            )
        )
    decode_steps = draw(st.lists(st.sampled_from([1, 1, 3]), min_size=1, max_size=8))
    return cfg, num_pages, requests, decode_steps


def check_output(sched, out, cfg):
    ids = [s.request_id for s in out.scheduled]
    assert len(ids) == len(set(ids)) <= cfg.max_num_seqs
    assert out.num_batched_tokens <= cfg.max_num_batched_tokens
    flags = [s.is_decode for s in out.scheduled]
    assert flags == sorted(flags, reverse=True), "a prefill was scheduled before a decode"
    for s in out.scheduled:
        assert s.num_new_tokens >= 1
        assert len(s.page_table) * cfg.page_size >= s.start_position + s.num_new_tokens
        if not s.is_decode:
            assert s.num_new_tokens <= cfg.prefill_chunk_size
    assert not set(out.preempted_ids) & set(ids)
    for r in sched.running:  # every running decode gets its token (the budget always covers them)
        if r.is_decoding:
            assert r.request_id in ids


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_invariants(workload):
    cfg, num_pages, specs, decode_steps = workload
    sched = Scheduler(cfg, num_pages)
    model = FakeModel(sched, vocab=8)  # STOP is sampled now and then
    live_hashes = set()
    if sched.cache is not None:

        def on_event(e, live=live_hashes):
            if isinstance(e, BlockStored):
                live.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                assert set(e.block_hashes) <= live
                live.difference_update(e.block_hashes)
                event("evicted")
            else:
                live.clear()

        sched.cache.subscribe(on_event)

    ends: dict[str, list] = {}
    accepted = {}
    for step in range(400):
        for spec in specs:
            req = spec["request"]
            if spec["arrive"] == step:
                try:
                    sched.add_request(req)
                    accepted[req.request_id] = req
                except ValueError:
                    longest = min(req.num_prompt_tokens + req.max_tokens, cfg.max_model_len) - 1
                    assert (
                        req.num_prompt_tokens >= cfg.max_model_len
                        or -(-longest // cfg.page_size) >= num_pages
                    )
            if spec["abort_at"] == step and sched.abort(req.request_id):
                ends.setdefault(req.request_id, []).append("abort")
        if step > 12 and not sched.has_unfinished_requests():
            break
        decoding = {r.request_id for r in sched.running if r.is_decoding}
        out = sched.schedule()
        check_output(sched, out, cfg)
        assert {s.request_id for s in out.scheduled if s.is_decode} <= decoding
        if out.preempted_ids:
            event("preempted")
        sched.check_integrity()
        sampled, stopped = model.step(out, decode_steps[step % len(decode_steps)])
        for r in sched.update_after_step(out, sampled, stopped):
            ends.setdefault(r.request_id, []).append(r.status)
        sched.check_integrity()
        if sched.cache is not None:
            assert live_hashes == set(sched.cache.block_hashes())
    else:
        raise AssertionError("workload did not drain")

    assert set(ends) == set(accepted)
    for rid, req in accepted.items():
        assert len(ends[rid]) == 1, f"{rid} ended {ends[rid]}"
        assert not req.pages and req.cache_node is None
        if ends[rid] == ["abort"]:
            assert req.status is RequestStatus.FINISHED_ABORTED
            continue
        assert req.output_token_ids == expected_output(req, cfg.max_model_len, model.vocab)
        if req.num_cached_tokens:
            event("prefix hit")
        if req.status is RequestStatus.FINISHED_STOPPED:
            assert req.output_token_ids[-1] == STOP
        else:
            assert req.status is RequestStatus.FINISHED_LENGTH
    if sched.cache is not None:
        assert sched.cache.reset()
    assert sched.pool.num_free == sched.pool.num_usable_pages


def test_preemption_counts_pinned_pages_as_taken():
    # A prefix pinned in the cache (as a KV transfer pins it) stays taken when the requests sharing
    # it are preempted, so a request needing those pages preempts further instead of running short.
    cfg = config(max_num_seqs=2, max_num_batched_tokens=13, long_prefill_token_threshold=12)
    sched = Scheduler(cfg, num_pages=7)  # 6 usable pages
    model = FakeModel(sched, vocab=1000)
    sched.add_request(Request("a", [1] * 8 + [5], max_tokens=1))
    run_to_completion(sched, model)
    pin = sched.cache.match_prefix([1] * 8, record=False)
    sched.cache.lock(pin.last_node)
    sched.add_request(Request("d", [2] * 24, max_tokens=1))
    sched.add_request(Request("b", [1] * 8 + [3], max_tokens=4))
    out, _ = run_step(sched, model)
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("d", 12), ("b", 1)]
    assert sched.get_request("b").pages[:2] == list(pin.pages)
    assert sched.pool.num_free + sched.cache.num_evictable_pages == 0
    # d needs 3 pages for its next chunk; b frees only its private page (the shared two stay pinned).
    out, _ = run_step(sched, model)
    assert out.preempted_ids == ("b", "d") and out.is_empty
    sched.cache.unlock(pin.last_node)
    sched.check_integrity()  # (it counts locks exactly, so only once the pin is gone)
    _, finished = run_to_completion(sched, model)
    for r in finished:
        assert r.output_token_ids == expected_output(r, cfg.max_model_len, model.vocab)
    assert {r.request_id for r in finished} == {"b", "d"}
