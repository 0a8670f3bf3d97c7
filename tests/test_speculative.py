"""Speculative decoding with n-gram drafts: the proposer, the verification rule, and on the real
SmolLM2 the equivalence that defines it: the same tokens as decoding without drafts, in fewer steps."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from jaxserve.engine.runner import RunnerConfig, StepOutput
from jaxserve.engine.scheduler_output import ScheduledRequest
from jaxserve.engine.speculative import (
    DraftBackoff,
    Drafter,
    StepCosts,
    draft_rows,
    propose_ngram,
    row_outputs,
)
from jaxserve.engine.step_batch import mixed_inputs
from jaxserve.engine_args import EngineArgs, SpeculativeConfig
from jaxserve.sampling_params import SamplingParams
from jaxserve.structured_outputs import StructuredOutputsParams as SO
from tests.conftest import REAL_ENGINE_ARGS
from tests.test_engine_real import pool_is_full, serve, serve_unchecked

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def test_propose_takes_what_followed_the_latest_longest_match():
    t = np.array([1, 2, 3, 9, 9, 5, 2, 3, 7, 8, 4, 1, 2, 3], np.int32)
    # The 3-token suffix [1, 2, 3] occurs at 0; its continuation is [9, 9, 5, 2].
    assert propose_ngram(t, 4, 2, 4).tolist() == [9, 9, 5, 2]
    assert propose_ngram(t, 2, 2, 4).tolist() == [9, 9]
    # With only 2-token lookups, [2, 3] last occurred at 6: [7, 8, 4].
    assert propose_ngram(t, 3, 2, 2).tolist() == [7, 8, 4]
    assert propose_ngram(np.array([5, 6, 7, 8], np.int32), 4, 1, 4).size == 0, "no earlier occurrence"
    assert propose_ngram(np.array([4, 4, 4, 4], np.int32), 4, 2, 2).tolist() == [4], "overlapping: what is left"
    assert propose_ngram(np.array([4], np.int32), 4, 1, 4).size == 0


@pytest.mark.parametrize("collide", [False, True])
def test_incremental_index_proposes_what_the_full_lookup_does(monkeypatch, collide):
    """`NgramIndex`, grown a few tokens at a time, proposes what `propose_ngram` proposes over the whole
    context after every growth; with a hash that keeps only each window's last token (every window
    ending alike collides), the token check still picks the true match."""
    from jaxserve.engine import speculative

    if collide:
        monkeypatch.setattr(speculative, "_HASH_MUL", np.uint32(0))
    rng = np.random.default_rng(7)
    checked = found = 0
    for trial in range(12):
        vocab = [3, 5, 50][trial % 3]  # small vocabularies repeat n-grams often
        tokens = rng.integers(0, vocab, 600).astype(np.int32)
        n_min, n_max = [(1, 4), (2, 4), (3, 3)][trial % 3]
        index, L = speculative.NgramIndex(n_min, n_max), 0
        while L < len(tokens):
            step = int(rng.choice([1, 1, 1, 2, 7, 64]))
            index.extend(tokens[L:L + step].tolist())
            L = min(L + step, len(tokens))
            want = propose_ngram(tokens[:L], 5, n_min, n_max)
            assert index.propose(5).tolist() == want.tolist(), (trial, L)
            checked, found = checked + 1, found + bool(want.size)
    assert found > checked // 2 and found < checked  # both hits and misses were compared


def test_index_follows_a_request_as_it_grows():
    from jaxserve.engine.request import Request
    from jaxserve.engine.speculative import NgramIndex

    req = Request("r", [1, 2, 3, 9, 9, 5, 2], max_tokens=8)
    index = NgramIndex(2, 4).sync(req)
    assert index.size == 7 and index.propose(4).size == 0
    req.output_token_ids.extend([3, 7, 8, 4, 1, 2, 3])
    assert index.sync(req).propose(4).tolist() == [9, 9, 5, 2] and index.size == 14


def test_config_is_checked_and_named():
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert EngineArgs.from_cli_args(ns).speculative_config == SpeculativeConfig(num_speculative_tokens=3)
    assert EngineArgs(speculative_config=json.dumps(SPEC)).speculative_config == SpeculativeConfig()
    assert EngineArgs(speculative_config={"num_speculative_tokens": 2}).speculative_config.num_speculative_tokens == 2
    chunks = EngineArgs(speculative_config={"draft_verification": "chunks"}).speculative_config
    assert chunks.chunked and not SpeculativeConfig().chunked
    for bad, match in [({"method": "medusa"}, "ngram"), ({"method": "eagle"}, "needs the draft model"),
                       ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"draft_verification": "tree"}, "draft_verification"),
                       ({"prompt_lookup_min": 5}, "prompt_lookup_min"), ({"draft_model": "x"}, "draft_model"),
                       ("{not json", "not JSON"), ("[1]", "JSON object")]:
        with pytest.raises(ValueError, match=match):
            EngineArgs(speculative_config=bad)


def test_backoff_skips_more_steps_after_each_failure_and_resets_on_success():
    pace = DraftBackoff()
    skipped = []
    for accepted in (0, 0, 0, 2, 0):
        assert pace.ready()
        pace.record(accepted)
        n = 0
        while not pace.ready():
            n += 1
        skipped.append(n)
        pace.wait = 0
    assert skipped == [1, 2, 4, 0, 1]


def test_verify_takes_drafts_while_the_samples_agree():
    s = [ScheduledRequest("a", 1, 10, (5,), (1,), True, True), ScheduledRequest("b", 3, 0, (1, 2, 3), (2,), True, False),
         ScheduledRequest("c", 1, 7, (6,), (3,), True, True)]
    drafter = Drafter(SpeculativeConfig())
    step = draft_rows(s, {"a": [11, 12, 13], "c": [20]}, lambda rid: [1, 4], drafter,
                      {"a": DraftBackoff(), "c": DraftBackoff()})
    assert [(r.request_id, r.start_position, r.token_ids) for r in step.rows] == [
        ("a", 10, (5,)), ("a", 11, (11,)), ("a", 12, (12,)), ("a", 13, (13,)), ("b", 0, (1, 2, 3)),
        ("c", 7, (6,)), ("c", 8, (20,))]
    assert all(r.page_table == (1, 4) for r in step.rows if r.request_id == "a")
    assert row_outputs(step, {"a": [5], "b": [], "c": [6]}) == [[5], [5, 11], [5, 11, 12], [5, 11, 12, 13], [],
                                                                [6], [6, 20]]
    # a: t0 = 11 = d1, t1 = 12 = d2, t2 = 99 != d3: takes 11, 12, 99. b: its one token. c: t0 = 21 != d1.
    tok = np.array([11, 12, 99, 13, 7, 21, 22], np.int32)
    z = np.zeros(7, np.float32)
    got = step.verify(StepOutput(tok, z, z.astype(np.int32), np.zeros((7, 2), np.int32), np.zeros((7, 2)),
                                 np.ones(7, np.int32)))
    assert {k: v.token_ids.tolist() for k, v in got.items()} == {"a": [11, 12, 99], "b": [7], "c": [21]}
    c = drafter.counters
    assert (c.spec_num_drafts, c.spec_num_draft_tokens, c.spec_num_accepted_tokens) == (2, 4, 2)
    assert c.spec_num_accepted_tokens_per_pos == [1, 1]  # a's first and second drafts
    other = Drafter(SpeculativeConfig())
    other.record(4, 3)
    other.record(2, 1)
    assert other.counters.spec_num_accepted_tokens_per_pos == [2, 1, 1]
    # The step runs each drafted request as one sequence of its token and drafts, with logits at each: a's 4
    # tokens, then b's chunk (its last token's logits), then c's 2; a row per sampled token, in the rows' order.
    rc = RunnerConfig(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=64, page_size=16, num_pages=8,
                      num_scheduler_steps=1, backend="xla")
    inputs, S = mixed_inputs(step.rows, rc, lora_slots=[0, 0, 0, 0, -1, 1, 1], merge=True)
    assert S == 16 and np.asarray(inputs.token_ids)[:9].tolist() == [5, 11, 12, 13, 1, 2, 3, 6, 20]
    assert np.asarray(inputs.query_start_loc)[:5].tolist() == [0, 4, 7, 9, 9]
    assert np.asarray(inputs.seq_lens)[:4].tolist() == [14, 3, 9, 0]
    assert np.asarray(inputs.positions)[:9].tolist() == [10, 11, 12, 13, 0, 1, 2, 7, 8]
    assert np.asarray(inputs.logits_indices)[:7].tolist() == [0, 1, 2, 3, 6, 7, 8]
    assert np.asarray(inputs.lora_slots)[:9].tolist() == [0, 0, 0, 0, -1, -1, -1, 1, 1]
    undrafted, _ = mixed_inputs(s, rc)
    assert np.asarray(undrafted.logits_indices)[:3].tolist() == [0, 3, 4]
    as_rows, _ = mixed_inputs(step.rows, rc)  # the other form: a sequence per row
    assert np.asarray(as_rows.query_start_loc)[:8].tolist() == [0, 1, 2, 3, 4, 7, 8, 9]
    assert np.asarray(as_rows.logits_indices)[:7].tolist() == [0, 1, 2, 3, 6, 7, 8]
    assert step.paces["a"].wait == 0 and step.paces["c"].wait == 1, "c accepted nothing: it skips a step"
    # Checked drafts: a's 1st, 2nd, 3rd (2 accepted), then c's 1st (rejected), on the prior of 2 in 4.
    hits, tries = (2 * 0.98 + 2) * 0.98, (4 * 0.98 + 3) * 0.98 + 1
    assert drafter.rate.p == pytest.approx(hits / tries)


def test_drafts_verified_are_those_worth_their_cost():
    """Without drafts a decode-only step runs in its sequence bucket's decode step; with them, as rows, in
    the decode step of the bucket that holds its rows, or chunked, in the mixed step of the token bucket
    that does."""
    seqs, tokens = (1, 4, 8, 16, 32), (4, 8, 16, 32)
    buckets = dict(seq_bucket=lambda n: next(b for b in seqs if b >= n),
                   verify_bucket=lambda n: next(b for b in tokens if b >= n))
    as_rows = dict(seq_bucket=buckets["seq_bucket"], verify_bucket=buckets["seq_bucket"])

    def drafter(decode, mixed=None):
        decode = dict(zip(seqs, decode, strict=True))
        verify = decode if mixed is None else dict(zip(tokens, mixed, strict=True))
        form = "rows" if mixed is None else "chunks"
        return Drafter(SpeculativeConfig(draft_verification=form), StepCosts(decode, verify))

    # As rows: one request verifies three (a fourth would move the step to the 8-row bucket: 3.36 expected
    # tokens for 1.3 against 2.95 for 1.1).
    rows = drafter([1.0, 1.1, 1.3, 2.5, 5.5])
    rows.rate.hits = rows.rate.tries * 0.8
    assert rows.choose(1, {"a": 4}, room=31, decode_only=True, **as_rows) == {"a": 3}

    # Chunked.
    flat = drafter([1.0] * 5, [1.0] * 4)
    assert flat.choose(2, {"a": 3, "b": 3}, room=30, decode_only=True, **buckets) == {"a": 3, "b": 3}
    assert flat.choose(2, {"a": 3, "b": 3}, room=3, decode_only=True, **buckets) == {"a": 2, "b": 1}, \
        "first drafts before second ones"
    # Cost growing with the bucket's rows (compute bound): no draft pays at an acceptance of one half.
    linear = drafter([float(b) for b in seqs], [float(b) for b in tokens])
    assert linear.choose(1, {"a": 4}, room=31, decode_only=True, **buckets) == {}
    # Bound by the weights at small batches: one request verifies three (a fourth would move the step to
    # the 8-token bucket: 3.36 expected tokens for 1.4 against 2.95 for 1.2); twelve fill their bucket.
    cpu = drafter([1.0, 1.1, 1.3, 2.5, 5.5], [1.2, 1.4, 2.6, 5.6])
    cpu.rate.hits = cpu.rate.tries * 0.8
    assert cpu.choose(1, {"a": 4}, room=31, decode_only=True, **buckets) == {"a": 3}
    cpu.rate.hits = cpu.rate.tries * 0.95
    assert cpu.choose(1, {"a": 4}, room=31, decode_only=True, **buckets) == {"a": 4}
    got = cpu.choose(12, {f"r{i}": 4 for i in range(12)}, room=20, decode_only=True, **buckets)
    assert sum(got.values()) == 4 and set(got.values()) == {1}
    # A mixed step much dearer than the decode step of the same rows: drafts no longer pay.
    dear = drafter([1.0, 1.1, 1.3, 2.5, 5.5], [5.0, 5.5, 6.0, 9.0])
    dear.rate.hits = dear.rate.tries * 0.95
    assert dear.choose(1, {"a": 4}, room=31, decode_only=True, **buckets) == {}
    # Beside a prefill chunk, drafts fill the room given (the token bucket's padding), whatever the costs.
    assert linear.choose(3, {"a": 4}, room=2, decode_only=False, **buckets) == {"a": 2}


def test_a_draft_model_drafts_only_when_its_drafts_can_pay():
    """A draft model's loop is paid before its drafts are seen: a decode-only step drafts when the drafts it could
    verify, at the acceptance so far, pay for the loop and their rows (measured costs), and skips the loop when
    they cannot."""
    rc = RunnerConfig(max_num_seqs=32, max_num_batched_tokens=32, max_model_len=64, page_size=8, num_pages=64,
                      num_scheduler_steps=1, backend="xla")
    asked = []

    class Model:
        def propose(self, rows):
            asked.append([(rid, n) for rid, *_, n in rows])
            return {rid: np.full(n, 5, np.int32) for rid, *_, n in rows}

    def plan(draft_seconds: float, p: float) -> dict[str, list[int]]:
        decode = {b: 1.0 for b in rc.seq_buckets}  # bound by reading the weights: rows cost nothing
        drafter = Drafter(SpeculativeConfig(method="draft_model", model="m", num_speculative_tokens=3),
                          StepCosts(decode, decode, {b: draft_seconds for b in rc.seq_buckets}), Model())
        drafter.rate.hits = drafter.rate.tries * p
        rows = [ScheduledRequest(f"r{i}", 1, 10, (3,), (1, 2), True, True) for i in range(2)]
        step = drafter.plan(rows, 2, rc, request_of=None, pace_of=lambda rid: DraftBackoff(),
                            reserve=lambda rid, n: n, pages_of=lambda rid: [1, 2])
        return {} if step is None else step.drafts

    # Two requests at p = 0.8 expect 2 * (0.8 + 0.64 + 0.512) = 3.9 more tokens a step: worth a loop costing half a
    # step (5.9 tokens for 1.5 steps against 2 for 1), not one of three steps.
    assert plan(0.5, 0.8) == {"r0": [5, 5, 5], "r1": [5, 5, 5]} and asked == [[("r0", 3), ("r1", 3)]]
    asked.clear()
    assert plan(3.0, 0.8) == {} and asked == []
    assert plan(0.5, 0.1) == {} and asked == [], "at p = 0.1: 2.2 tokens for 1.5 steps"


def test_drafts_turned_down_are_probed_and_their_rate_learned():
    """Costs that turn a draft model's loop down at the rate so far: after PROBE_EVERY such steps one step drafts
    anyway; drafts always accepted raise the rate until drafting pays on its own, drafts never accepted leave it to
    a probe every PROBE_EVERY steps."""
    from jaxserve.engine.speculative import PROBE_EVERY

    rc = RunnerConfig(max_num_seqs=32, max_num_batched_tokens=32, max_model_len=64, page_size=8, num_pages=64,
                      num_scheduler_steps=1, backend="xla")

    class Model:
        def propose(self, rows):
            return {rid: np.full(n, 5, np.int32) for rid, *_, n in rows}

    def drafted(accept: bool) -> list[int]:
        decode = {b: 1.0 for b in rc.seq_buckets}  # the loop costs 1.5 steps: it pays from a rate of about 0.74
        drafter = Drafter(SpeculativeConfig(method="draft_model", model="m", num_speculative_tokens=3),
                          StepCosts(decode, decode, {b: 1.5 for b in rc.seq_buckets}), Model())
        rows = [ScheduledRequest(f"r{i}", 1, 10, (3,), (1, 2), True, True) for i in range(2)]
        counts = []
        for _ in range(3 * PROBE_EVERY):
            step = drafter.plan(rows, 2, rc, request_of=None, pace_of=lambda rid: DraftBackoff(),
                                reserve=lambda rid, n: n, pages_of=lambda rid: [1, 2])
            counts.append(0 if step is None else sum(len(d) for d in step.drafts.values()))
            for d in (step.drafts.values() if step else ()):
                drafter.record(len(d), len(d) if accept else 0)
        return counts

    accepted = drafted(True)
    assert accepted[:PROBE_EVERY - 1] == [0] * (PROBE_EVERY - 1) and min(accepted[PROBE_EVERY - 1:]) == 6
    rejected = drafted(False)
    assert [i for i, n in enumerate(rejected) if n] == [PROBE_EVERY - 1, 2 * PROBE_EVERY - 1, 3 * PROBE_EVERY - 1]


CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n"


slow = pytest.mark.slow


class _Engines:
    """One engine with drafts; `base` serves through it with drafts off (the same weights, shapes and
    compiled steps, one warmup). A request's output without drafts does not depend on what it was batched
    with (tests/test_engine_real.py), so each one is served once for the module and kept."""

    def __init__(self, engine):
        self.spec = engine
        self.served = {}

    def base(self, prompts, params, checked=True):
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        keys = [(tuple(p), repr(sp)) for p, sp in zip(prompts, params, strict=True)]
        todo = {k: (p, sp) for k, p, sp in zip(keys, prompts, params, strict=True) if k not in self.served}
        if todo:
            drafter, self.spec.drafter = self.spec.drafter, None
            try:
                outs = (serve if checked else serve_unchecked)(self.spec, *map(list, zip(*todo.values(), strict=True)))
            finally:
                self.spec.drafter = drafter
            self.served.update(zip(todo, outs, strict=True))
        return [self.served[k] for k in keys]


@pytest.fixture(scope="module")
def engines(smollm_f32):
    import jax.numpy as jnp

    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine.model_loading import LoadedModel
    from jaxserve.loader import bundled_model_path
    from jaxserve.tokenizer import Tokenizer

    cfg, params = smollm_f32
    path = bundled_model_path()
    loaded = LoadedModel(path, "SmolLM2-135M-Instruct", cfg, params, Tokenizer.from_gguf(path), jnp.float32, 0.0)
    return _Engines(LLMEngine(EngineArgs(**REAL_ENGINE_ARGS, speculative_config=SPEC), loaded=loaded, progress=False))


def _prompts(tok):
    asks = ["Repeat this code exactly:\n" + CODE, "Write the numbers from 1 to 30 separated by commas.",
            "List the days of the week, one per line.", "What is the capital of France?"]
    return [tok.encode_chat([{"role": "user", "content": a}]) for a in asks]


PARAMS = [
    SamplingParams(temperature=0, max_tokens=60),
    SamplingParams(temperature=0.8, seed=11, max_tokens=40, n=2),
    SamplingParams(temperature=0, max_tokens=50, frequency_penalty=0.4, logprobs=2),
    SamplingParams(temperature=0, max_tokens=37, min_tokens=30, stop=["Sunday"]),
]


def assert_same_outputs(want, got) -> None:
    """The same tokens, text and finish reasons, and logprobs within float32 noise."""
    for w, g in zip(want, got, strict=True):
        for a, b in zip(w.outputs, g.outputs, strict=True):
            assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
            if a.logprobs is not None:
                for x, y in zip(a.logprobs, b.logprobs, strict=True):
                    assert x.keys() == y.keys()
                    assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)


@slow
def test_drafts_change_nothing_but_the_number_of_steps(engines):
    spec = engines.spec
    prompts = _prompts(spec.tokenizer)
    jobs = [(p, sp) for p in prompts for sp in PARAMS]
    want = engines.base([p for p, _ in jobs], [sp for _, sp in jobs])
    got = serve(spec, [p for p, _ in jobs], [sp for _, sp in jobs])
    assert_same_outputs(want, got)
    stats = spec.stats()
    assert stats.spec_num_accepted_tokens > 50 and stats.spec_num_draft_tokens > stats.spec_num_accepted_tokens
    assert stats.compilations_after_warmup == 0
    # Alone, the code to repeat comes at well over a token per forward pass.
    steps = spec.runner.num_steps
    out = serve(spec, [prompts[0]], PARAMS[0])[0].outputs[0]
    assert out.token_ids == want[0].outputs[0].token_ids
    assert spec.runner.num_steps - steps - 1 < len(out.token_ids) / 2  # the first step is the prefill
    assert pool_is_full(spec)


@slow
def test_suffix_decoding_drafts_from_earlier_responses(engines):
    """Suffix decoding (`engine.suffix_decoding`): the same outputs as without drafts; asked again, a question's
    answer is drafted from the cached response, nearly all of it taken, in under half the steps."""
    spec = engines.spec
    # (costs None: every draft the step has room for verified; on the CPU the measured costs draft little)
    ngram, spec.drafter = spec.drafter, Drafter(SpeculativeConfig(method="suffix"), None)
    try:
        prompts = _prompts(spec.tokenizer)[1:]
        jobs = [(p, sp) for p in prompts for sp in PARAMS[:3]]
        want = engines.base([p for p, _ in jobs], [sp for _, sp in jobs])
        got = serve(spec, [p for p, _ in jobs], [sp for _, sp in jobs])
        assert_same_outputs(want, got)
        assert len(spec.drafter.suffix._cached) == 3 * 4  # (n=2: two responses)
        first = spec.drafter.counters.spec_num_accepted_tokens
        steps = spec.runner.num_steps
        out = serve(spec, [prompts[0]], PARAMS[0])[0].outputs[0]
        assert out.token_ids == want[0].outputs[0].token_ids
        taken = spec.drafter.counters.spec_num_accepted_tokens - first
        assert taken >= 0.8 * len(out.token_ids), (taken, len(out.token_ids))
        assert spec.runner.num_steps - steps - 1 < len(out.token_ids) / 2  # the first step is the prefill
        assert spec.stats().compilations_after_warmup == 0
    finally:
        spec.drafter = ngram


@slow
def test_a_predicted_output_drafts_and_changes_nothing(engines):
    """OpenAI's predicted outputs (`SamplingParams.prediction`): a right prediction is drafted from, nearly all of it
    taken, in under half the steps; a wrong one is not taken; the outputs are the same either way."""
    spec = engines.spec
    costs, spec.drafter.costs = spec.drafter.costs, None  # (every draft the step has room for verified)
    try:
        prompt = _prompts(spec.tokenizer)[2]  # the days of the week
        want = engines.base([prompt], PARAMS[0])[0].outputs[0]
        steps = spec.runner.num_steps
        got = serve(spec, [prompt], dataclasses.replace(PARAMS[0], prediction=want.text))[0].outputs[0]
        assert got.token_ids == want.token_ids and got.text == want.text
        n, decodes = len(spec.tokenizer.encode(want.text)), spec.runner.num_steps - steps - 1  # (and a prefill)
        assert decodes < len(got.token_ids) / 4  # 4 drafts a step, nearly all taken
        # Every token but the prefill's and each decode step's own came from the prediction, or nearly.
        assert got.accepted_prediction_tokens >= len(got.token_ids) - 1 - decodes - 4, (got, decodes)
        assert got.rejected_prediction_tokens == n - got.accepted_prediction_tokens
        wrong = serve(spec, [prompt], dataclasses.replace(PARAMS[0], prediction="zebra " * 30))[0].outputs[0]
        assert wrong.token_ids == want.token_ids and wrong.accepted_prediction_tokens == 0
        plain = serve(spec, [prompt], PARAMS[0])[0].outputs[0]
        assert plain.accepted_prediction_tokens is None and plain.rejected_prediction_tokens is None
    finally:
        spec.drafter.costs = costs


@slow
def test_drafts_verified_as_chunks_change_nothing(engines):
    """The GPU backends' form on the CPU: each drafted request one sequence of its token and drafts, with
    logits at each, in a mixed step (every proposed draft verified: no costs); the same outputs again."""
    spec = engines.spec
    prompts = _prompts(spec.tokenizer)
    jobs = [(p, sp) for p in prompts for sp in (PARAMS[0], PARAMS[1], PARAMS[2])]
    want = engines.base([p for p, _ in jobs], [sp for _, sp in jobs])
    kinds = []
    launch, rows_form = spec._launch, spec.drafter

    def watch():
        launched = launch()
        if launched is not None and launched[3] is not None and all(s.is_decode for s in launched[0].scheduled):
            kinds.append(launched[1].kind)
        return launched

    spec._launch, spec.drafter = watch, Drafter(dataclasses.replace(rows_form.cfg, draft_verification="chunks"))
    try:
        got = serve(spec, [p for p, _ in jobs], [sp for _, sp in jobs])
        accepted = spec.drafter.counters.spec_num_accepted_tokens
    finally:
        spec._launch, spec.drafter = launch, rows_form
    assert_same_outputs(want, got)
    assert kinds and set(kinds) == {"mixed"} and accepted > 30
    assert spec.stats().compilations_after_warmup == 0
    assert pool_is_full(spec)


@slow
def test_drafts_verified_beside_a_prefill_chunk(engines):
    """Requests arriving while another decodes with drafts: a step with a prefill chunk verifies drafts
    in its token bucket's padding (a mixed step of one-token draft rows); every output still equals
    its output without drafts."""
    spec = engines.spec
    prompts = _prompts(spec.tokenizer)
    greedy = PARAMS[0]
    want = [o.outputs[0].token_ids for o in engines.base(prompts, greedy)]
    spec.reset_prefix_cache()
    mixed_steps = []
    launch = spec._launch

    def watch():
        launched = launch()
        if launched is not None and launched[3] is not None and not all(s.is_decode for s in launched[0].scheduled):
            mixed_steps.append(launched[0].step)  # drafts verified beside a prefill chunk
        return launched

    spec._launch = watch
    events = []
    spec.trace = lambda rid, layer, event, data: events.append((rid, layer, event, data))
    done = {}

    def step():
        for out in spec.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids

    try:
        spec.add_request("r0", prompts[0], greedy)
        for i in (1, 2, 3):
            # Each arrives right after a step that accepted drafts, so the next steps likely draft too.
            for _ in range(40):
                before = spec.drafter.counters.spec_num_accepted_tokens
                step()
                if spec.drafter.counters.spec_num_accepted_tokens > before or not spec.has_unfinished_requests():
                    break
            spec.add_request(f"r{i}", prompts[i], greedy)
        while spec.has_unfinished_requests():
            step()
    finally:
        spec._launch = launch
        spec.trace = None
    assert mixed_steps
    drafted = [(rid, d["step"], len(d["token_ids"])) for rid, layer, event, d in events if event == "drafts"]
    assert drafted and all(layer == "L5" for _, layer, event, _ in events if event == "drafts")
    # On the CPU drafts are verified as rows: a drafted decode-only step's bucket holds a row per request and
    # per draft.
    rows = {d["step"]: d["batch_seqs"] for _, _, event, d in events if event == "scheduled"}
    for _, step_id, n in drafted:
        rows[step_id] += n
    buckets = {d["step"]: d for _, _, event, d in events if event == "bucket"}
    decode_steps = [step_id for _, step_id, _ in drafted if buckets[step_id]["kind"] == "decode"]
    assert decode_steps and all(buckets[s]["num_seqs"] >= rows[s] for s in decode_steps)
    assert [done[f"r{i}"] for i in range(4)] == want
    spec.check_integrity()
    assert pool_is_full(spec)


@slow
def test_constrained_requests_are_drafted_and_unchanged(engines):
    """Under a JSON schema whose objects repeat their keys, drafts are proposed, cut where the grammar
    refuses them, verified under each row's mask and taken: the outputs equal those without drafts (a
    constrained request beside free ones), in fewer steps."""
    spec = engines.spec
    tok = spec.tokenizer
    prompts = _prompts(tok)[1:3] + [tok.encode_chat([{"role": "user", "content":
                                                        "List the days of the week with their numbers, as JSON."}])]
    so = SamplingParams(temperature=0, max_tokens=120, structured_outputs=SO(json=DAYS_SCHEMA))
    greedy = PARAMS[0]
    params = [greedy, greedy, so]
    want = [o.outputs[0] for o in engines.base(prompts, params, checked=False)]
    asked = []
    plan = spec.drafter.plan

    def watch(scheduled, *args, **kw):
        asked.extend(s.request_id for s in scheduled if s.is_decode and kw["pace_of"](s.request_id) is not None)
        return plan(scheduled, *args, **kw)

    spec.drafter.plan = watch
    try:
        got = serve_unchecked(spec, prompts, params)
    finally:
        del spec.drafter.plan
    assert [(o.outputs[0].token_ids, o.outputs[0].text) for o in got] == [(w.token_ids, w.text) for w in want]
    days = json.loads(got[2].outputs[0].text)["days"]
    assert len(days) >= 2 and got[2].outputs[0].finish_reason == "stop"
    assert got[2].request_id in asked
    spec.check_integrity()
    # Alone, the constrained answer takes drafts: fewer steps than tokens.
    before, steps = spec.drafter.counters.spec_num_accepted_tokens, spec.runner.num_steps
    alone = serve_unchecked(spec, prompts[2:], params[2:])[0].outputs[0]
    assert alone.token_ids == want[2].token_ids
    assert spec.drafter.counters.spec_num_accepted_tokens - before >= 5
    assert spec.runner.num_steps - steps < len(alone.token_ids)
    assert pool_is_full(spec)


DAYS_SCHEMA = {"type": "object", "required": ["days"], "properties": {"days": {
    "type": "array", "maxItems": 3, "items": {"type": "object", "required": ["name", "number"],
                                              "additionalProperties": False, "properties": {
        "name": {"type": "string"}, "number": {"type": "integer"}}}}}}


def test_grammar_masks_along_drafts_and_back():
    """Each draft row's mask is the grammar's after the drafts before it, as a matcher that took them
    one by one computes; the matcher ends where it began; a completed grammar's rows allow only EOS."""
    from jaxserve.loader import bundled_model_path
    from jaxserve.structured_outputs import GrammarCompiler, bitmask_width
    from jaxserve.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(bundled_model_path())
    grammars = GrammarCompiler(tok, 49152)
    ids = tok.encode('{"days": [{"name": "Monday", "number": 1}, {"name": "Tuesday", "number": 2}]}')
    m = grammars.matcher(SO(json=DAYS_SCHEMA))
    for t in ids[:5]:
        assert m.consume(t)
    drafts = ids[5:11]
    eos = tok.eos_token_ids[0]
    assert m.valid_prefix(drafts) == 6 and m.valid_prefix(drafts[:3] + [eos] + drafts[3:]) == 3  # not done yet
    got = np.zeros((8, bitmask_width(49152)), np.int32)
    m.fill_bitmasks(got, 1, drafts)
    step = grammars.matcher(SO(json=DAYS_SCHEMA))
    want = np.zeros_like(got)
    for t in ids[:5]:
        step.consume(t)
    for j in range(len(drafts) + 1):
        step.fill_bitmask(want, 1 + j)
        if j < len(drafts):
            step.consume(drafts[j])
    np.testing.assert_array_equal(got, want)
    assert len({got[r].tobytes() for r in range(1, 8)}) > 2  # the masks did move along the drafts
    again = np.zeros_like(got)
    m.fill_bitmask(again, 1)
    np.testing.assert_array_equal(again[1], got[1])
    assert m.valid_prefix(ids[5:]) == len(ids) - 5

    done = grammars.matcher(SO(regex="(ab)+c"))
    abc = tok.encode("ababc")
    assert done.valid_prefix(abc + [eos, eos]) == len(abc) + 1
    rows = np.zeros((len(abc) + 2, bitmask_width(49152)), np.int32)
    done.fill_bitmasks(rows, 0, abc + [eos])
    eos_only = np.zeros(bitmask_width(49152) * 32, np.uint8)
    eos_only[eos] = 1
    assert (rows[len(abc)] == np.packbits(eos_only, bitorder="little").view(np.int32)).all()
    assert (rows[len(abc) + 1] == rows[len(abc)]).all()
    assert done.valid_prefix(abc) == len(abc) and not done.stopped


@slow
def test_a_draft_model_changes_nothing_but_the_number_of_steps(engines, smollm_f32):
    """SmolLM2 drafting for itself, read again from its GGUF (the real vocabulary checked; no warmup: the shapes
    it meets compile): the greedy outputs without drafts, nearly every draft accepted, in fewer steps than
    tokens. tests/test_draft_model.py holds the rest on tiny models."""
    import jax.numpy as jnp

    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine.model_loading import LoadedModel
    from jaxserve.loader import bundled_model_path
    from jaxserve.tokenizer import Tokenizer

    cfg, params = smollm_f32
    path = bundled_model_path()
    loaded = LoadedModel(path, "SmolLM2-135M-Instruct", cfg, params, Tokenizer.from_gguf(path), jnp.float32, 0.0)
    args = dict(REAL_ENGINE_ARGS, kv_cache_memory_bytes=2 * REAL_ENGINE_ARGS["kv_cache_memory_bytes"], warmup=False,
                speculative_config={"model": path, "num_speculative_tokens": 4})
    engine = LLMEngine(EngineArgs(**args), loaded=loaded, progress=False)
    assert engine.scheduler.pool.num_pages == engines.spec.scheduler.pool.num_pages  # the budget holds both pools
    prompts = _prompts(engine.tokenizer)[:2]  # (the code to repeat, the numbers to count)
    jobs = [(p, sp) for p in prompts for sp in (PARAMS[0], PARAMS[3])]
    want = engines.base([p for p, _ in jobs], [sp for _, sp in jobs])
    got = serve(engine, [p for p, _ in jobs], [sp for _, sp in jobs])
    assert_same_outputs(want, got)
    stats = engine.stats()
    assert stats.spec_num_draft_tokens > 100 and stats.spec_num_accepted_tokens > 0.9 * stats.spec_num_draft_tokens
    steps = engine.runner.num_steps
    out = serve(engine, [prompts[1]], PARAMS[0])[0].outputs[0]
    assert out.token_ids == want[2].outputs[0].token_ids
    assert engine.runner.num_steps - steps - 1 < len(out.token_ids) / 2  # the first step is the prefill
    assert pool_is_full(engine)
