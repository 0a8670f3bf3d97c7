"""The engine loop on a hand-checkable model: stops, lengths, n > 1, aborts, multi-step decode."""

from __future__ import annotations

import asyncio
import re

import pytest

from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine_args import EngineArgs
from jaxserve.sampling_params import SamplingParams
from tests.fake_model import EOS, VOCAB, fake_loaded_model, text

ARGS = EngineArgs(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128, page_size=8,
                  kv_cache_memory_bytes=64 * 2 * 8 * 4 * 4, num_scheduler_steps=4, compile_cache_dir=None)


@pytest.fixture(scope="module")
def loaded():
    return fake_loaded_model()


def make_engine(loaded, **changes) -> LLMEngine:
    return LLMEngine(ARGS.replace(**changes), loaded=loaded, progress=False)


@pytest.fixture(scope="module")
def engine(loaded):
    return make_engine(loaded)


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]):
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    final = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in final, "a request finished twice"
                final[out.request_id] = out
        steps += 1
        assert steps < 500
    engine.check_integrity()
    assert engine.scheduler.pool.num_free + (engine.scheduler.cache.num_cached_pages if engine.scheduler.cache else 0) \
        == engine.scheduler.pool.num_usable_pages
    return final


def test_counts_up_and_stops_at_max_tokens(engine):
    out = run(engine, {"a": ([5, 6], SamplingParams(temperature=0, max_tokens=7))})["a"]
    c = out.outputs[0]
    assert c.token_ids == [7, 8, 9, 10, 11, 12, 13]
    assert c.text == text(c.token_ids)
    assert c.finish_reason == "length"
    assert engine.stats().compilations_after_warmup == 0


def test_eos_stops_and_wraps_vocab(engine):
    # VOCAB-2 -> VOCAB-1 -> 0 -> 1 (EOS): EOS ends the completion, kept in token_ids, not in text.
    out = run(engine, {"a": ([VOCAB - 3], SamplingParams(temperature=0, max_tokens=20))})["a"].outputs[0]
    assert out.token_ids == [VOCAB - 2, VOCAB - 1, 0, EOS]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert "<eos>" not in out.text


def test_ignore_eos_and_min_tokens(engine):
    out = run(engine, {"a": ([VOCAB - 2], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))})
    assert out["a"].outputs[0].token_ids == [VOCAB - 1, 0, 1, 2, 3]
    assert out["a"].outputs[0].finish_reason == "length"


def test_stop_token_ids_and_stop_strings(engine):
    outs = run(engine, {
        "ids": ([10], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[14])),
        "str": ([20], SamplingParams(temperature=0, max_tokens=20, stop=["t24 t25"])),
        "incl": ([30], SamplingParams(temperature=0, max_tokens=20, stop=["t33"], include_stop_str_in_output=True)),
    })
    ids = outs["ids"].outputs[0]
    assert ids.token_ids == [11, 12, 13, 14] and ids.stop_reason == 14 and ids.finish_reason == "stop"
    assert ids.text == " t11 t12 t13"
    s = outs["str"].outputs[0]
    assert s.finish_reason == "stop" and s.stop_reason == "t24 t25"
    assert s.text == " t21 t22 t23 "
    assert s.token_ids == [21, 22, 23, 24, 25]
    inc = outs["incl"].outputs[0]
    assert inc.text == " t31 t32 t33" and inc.token_ids == [31, 32, 33]


@pytest.mark.parametrize("steps", [1, 3, 8])
def test_outputs_identical_for_every_num_scheduler_steps(loaded, steps):
    eng = make_engine(loaded, num_scheduler_steps=steps)
    reqs = {f"r{i}": ([2 + i], SamplingParams(temperature=0, max_tokens=3 + i, stop=["t7"] if i == 2 else None))
            for i in range(6)}
    outs = run(eng, reqs)
    for i in range(6):
        expect = [5, 6, 7] if i == 2 else list(range(3 + i, 3 + i + 3 + i))
        assert outs[f"r{i}"].outputs[0].token_ids == expect, i
    assert outs["r2"].outputs[0].text == " t5 t6 "
    assert eng.stats().compilations_after_warmup == 0


def _summary(out):
    return [(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason, c.cumulative_logprob,
             None if c.logprobs is None else [{t: (lp.logprob, lp.rank, lp.decoded_token) for t, lp in e.items()}
                                             for e in c.logprobs]) for c in out.outputs]


@pytest.mark.parametrize("steps", [1, 4])
def test_async_scheduling_outputs_identical(loaded, steps):
    """Dispatching step N+1 before step N is detokenized changes no output: stop ids and strings,
    lengths, min_tokens, n > 1, logprobs, more requests than sequence slots."""
    reqs = {}
    for i in range(14):
        p = dict(temperature=0, max_tokens=4 + (i * 5) % 17)
        if i % 4 == 1:
            p["stop"] = [f"t{8 + i}"]
        if i % 4 == 2:
            p.update(stop_token_ids=[10 + i], min_tokens=2)
        if i % 5 == 3:
            p.update(n=2, logprobs=2)
        reqs[f"r{i}"] = ([2 + 3 * i], SamplingParams(**p))
    sync = make_engine(loaded, num_scheduler_steps=steps, async_scheduling=False)
    eager = make_engine(loaded, num_scheduler_steps=steps)
    want, got = run(sync, reqs), run(eager, reqs)
    assert sorted(got) == sorted(want) == sorted(reqs)
    for rid in reqs:
        assert _summary(got[rid]) == _summary(want[rid]), rid
    assert {c.finish_reason for o in got.values() for c in o.outputs} == {"stop", "length"}


def test_async_scheduling_keeps_a_step_in_flight_and_aborts_cleanly(loaded):
    eng = make_engine(loaded, num_scheduler_steps=1)
    eng.add_request("keep", [3], SamplingParams(temperature=0, max_tokens=12))
    eng.add_request("drop", [40], SamplingParams(temperature=0, max_tokens=12))
    first = eng.step()
    assert eng._inflight is not None, "the next step is on the device when step() returns"
    assert [o.outputs[0].token_ids for o in first] == [[4], [41]]
    out = eng.abort_request("drop")  # it is in the step in flight
    assert out.finished and out.outputs[0].token_ids == [41]
    final = run(eng, {})
    assert list(final) == ["keep"] and final["keep"].outputs[0].token_ids == list(range(4, 16))
    assert eng._inflight is None


def test_async_scheduling_failed_dispatch_surfaces_after_the_outputs(loaded):
    eng = make_engine(loaded, num_scheduler_steps=1)
    eng.add_request("a", [3], SamplingParams(temperature=0, max_tokens=5))
    dispatch = eng.runner.dispatch_decode

    def fail(*args, **kwargs):
        raise RuntimeError("device lost")

    eng.runner.dispatch_decode = fail
    outs = eng.step()  # the prefill's token goes out; dispatching the next step failed
    assert [o.outputs[0].token_ids for o in outs] == [[4]]
    with pytest.raises(RuntimeError, match="device lost"):
        eng.step()
    eng.runner.dispatch_decode = dispatch
    assert eng.abort_request("a").outputs[0].finish_reason == "abort"
    assert not eng.has_unfinished_requests()
    eng.check_integrity()


def test_n_completions(engine):
    out = run(engine, {"a": ([3], SamplingParams(n=3, temperature=0, max_tokens=2))})["a"]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.token_ids == [4, 5] for c in out.outputs)


def test_logprobs_reported(engine):
    out = run(engine, {"a": ([3], SamplingParams(temperature=0, max_tokens=2, logprobs=2))})["a"].outputs[0]
    assert len(out.logprobs) == 2
    first = out.logprobs[0]
    assert 4 in first and first[4].rank == 1 and first[4].logprob > -1e-3
    assert len(first) == 2
    assert out.cumulative_logprob == pytest.approx(sum(lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids, strict=False)))


def test_invalid_requests_are_refused_with_reasons(engine):
    with pytest.raises(ValueError, match="maximum context length is 128"):
        engine.add_request("long", list(range(2, 60)) * 3, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("big", [3], SamplingParams(max_tokens=500))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("vocab", [3, VOCAB + 5], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], SamplingParams(max_tokens=4))
    assert not engine.has_unfinished_requests()


def test_abort_frees_pages_midway(engine):
    engine.add_request("keep", [3], SamplingParams(temperature=0, max_tokens=30))
    engine.add_request("drop", [3], SamplingParams(temperature=0, max_tokens=30))
    engine.step()
    engine.step()
    out = engine.abort_request("drop")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    final = run(engine, {})
    assert final["keep"].outputs[0].token_ids == list(range(4, 34))


def test_async_engine_streams_and_aborts(loaded):
    async def main():
        eng = AsyncEngine(make_engine(loaded))
        try:
            seen = []
            async for out in eng.generate([5], SamplingParams(temperature=0, max_tokens=10), "s1"):
                seen.append(list(out.outputs[0].token_ids))
            assert seen[-1] == list(range(6, 16))
            assert all(a == b[: len(a)] for a, b in zip(seen, seen[1:], strict=False))
            # Closing the stream early aborts the request.
            gen = eng.generate([5], SamplingParams(temperature=0, max_tokens=100), "s2")
            await gen.__anext__()
            await gen.aclose()
            with pytest.raises(ValueError, match="context length"):
                async for _ in eng.generate([3] * 200, SamplingParams(max_tokens=4), "bad"):
                    pass
            results = await asyncio.gather(*[
                _collect(eng.generate([2 + i], SamplingParams(temperature=0, max_tokens=5), f"c{i}"))
                for i in range(12)
            ])
            for i, toks in enumerate(results):
                assert toks == list(range(3 + i, 8 + i))
            for _ in range(100):
                if eng.stats().num_running == 0 and eng.stats().num_waiting == 0:
                    break
                await asyncio.sleep(0.02)
            eng.check_integrity()
            assert eng.stats().num_running == 0
        finally:
            eng.shutdown()

    asyncio.run(main())


async def _collect(gen):
    last = None
    async for out in gen:
        last = out
    return last.outputs[0].token_ids


def test_logit_bias_holds_in_prefill_and_decode_loop_steps(engine):
    """+100 on one token makes the counting model repeat it, in the mixed step that samples the first
    token and in the on-device decode loop after it; a request without a bias in the same batch counts on."""
    out = run(engine, {
        "biased": ([5, 6], SamplingParams(temperature=0, max_tokens=9, logit_bias={20: 100})),
        "plain": ([5, 6], SamplingParams(temperature=0, max_tokens=9)),
    })
    assert out["biased"].outputs[0].token_ids == [20] * 9
    assert out["plain"].outputs[0].token_ids == list(range(7, 16))
    assert engine.stats().compilations_after_warmup == 0


def test_allowed_token_ids_hold_in_every_step(engine):
    """Greedy, the counting model takes the next id where allowed and else the lowest allowed id (all others tie);
    the mask holds in the first (mixed) step and through the device decode loop; drawn tokens stay in the set."""
    allowed = [3, 4, 10, 20]
    out = run(engine, {
        "greedy": ([2], SamplingParams(temperature=0, max_tokens=7, allowed_token_ids=allowed)),
        "drawn": ([2], SamplingParams(temperature=1.0, seed=0, max_tokens=24, allowed_token_ids=allowed)),
        "plain": ([2], SamplingParams(temperature=0, max_tokens=7)),
    })
    assert out["greedy"].outputs[0].token_ids == [3, 4, 3, 4, 3, 4, 3]
    assert set(out["drawn"].outputs[0].token_ids) <= set(allowed)
    assert out["plain"].outputs[0].token_ids == list(range(3, 10))
    assert engine.stats().compilations_after_warmup == 0


def test_bad_words_are_never_completed(engine):
    """A one-token bad word is never generated; a two-token one's second token never follows its first in the
    output, checked token by token (a mask fixed for a whole decode loop would let "t4 t5" through)."""
    out = run(engine, {
        "one": ([2], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, bad_words=["t4"])),
        "two": ([2], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, bad_words=["t4 t5"])),
        "prompt": ([4], SamplingParams(temperature=0, max_tokens=3, bad_words=["t4 t5"])),  # the output's, only
    })
    assert out["one"].outputs[0].token_ids == [3, 0, 1, 2, 3]
    assert out["two"].outputs[0].token_ids == [3, 4, 0, 1, 2, 3]
    assert out["prompt"].outputs[0].token_ids == [5, 6, 7]


def test_truncate_prompt_tokens_keeps_the_prompts_end(engine):
    out = run(engine, {"cut": ([2, 3, 4, 5, 6], SamplingParams(temperature=0, max_tokens=2, truncate_prompt_tokens=2)),
                       "all": ([2, 3, 4], SamplingParams(temperature=0, max_tokens=2, truncate_prompt_tokens=-1))})
    assert out["cut"].prompt_token_ids == [5, 6] and out["cut"].outputs[0].token_ids == [7, 8]
    assert out["all"].prompt_token_ids == [2, 3, 4]
    with pytest.raises(ValueError, match="truncate_prompt_tokens 129 exceeds this model's maximum context length 128"):
        engine.add_request("x", [5], SamplingParams(truncate_prompt_tokens=129))


@pytest.mark.parametrize("params, message", [
    (dict(allowed_token_ids=[]), "allowed_token_ids must not be empty"),
    (dict(allowed_token_ids=[3, -1]), "allowed_token_ids must be >= 0, got -1"),
    (dict(bad_words=["ok", " "]), "bad_words must be non-blank strings, got ' '"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens must be -1 (the model's context) or at least 1, got 0"),
])
def test_sampling_extras_are_checked(params, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**params)


def test_logit_bias_outside_the_vocabulary_is_refused(engine):
    with pytest.raises(ValueError, match=f"allowed_token_ids token id {VOCAB} is outside the vocabulary"):
        engine.add_request("x", [5], SamplingParams(allowed_token_ids=[3, VOCAB]))
    with pytest.raises(ValueError, match=f"logit_bias token id {VOCAB} is outside the vocabulary of {VOCAB}"):
        engine.add_request("x", [5], SamplingParams(logit_bias={3: 1.0, VOCAB: 1.0}))
    assert not engine.has_unfinished_requests()


def test_structured_outputs_refused_for_a_tokenizer_llguidance_cannot_read(engine):
    """The fake word-level tokenizer has no decoder llguidance knows: the request is refused, named, and
    the engine goes on serving."""
    from jaxserve.structured_outputs import StructuredOutputsParams

    with pytest.raises(ValueError, match="structured outputs are not available for this model's tokenizer"):
        engine.add_request("so", [5], SamplingParams(structured_outputs=StructuredOutputsParams(regex="t3+")))
    assert engine.num_requests == 0
    assert run(engine, {"b": ([5], SamplingParams(temperature=0, max_tokens=2))})["b"].outputs[0].token_ids == [6, 7]


def test_a_token_the_grammar_refuses_aborts_only_its_request(loaded):
    """Were a matcher to refuse a sampled token (its mask failed), that completion ends with "abort",
    the token's text left out; the batch beside it is untouched."""

    class Refuses:
        def __init__(self):
            self.taken = []

        def fill_bitmasks(self, bitmask, row, drafts):
            pass  # all allowed

        def consume(self, tok):
            self.taken.append(tok)
            return len(self.taken) < 3

        stopped, error = False, "refused for the test"

    eng = make_engine(loaded, num_scheduler_steps=1)
    eng.add_request("g", [5, 6], SamplingParams(temperature=0, max_tokens=8))
    eng._seq["g"].matcher = Refuses()
    final = run(eng, {"f": ([5, 6], SamplingParams(temperature=0, max_tokens=5))})  # "g" finishes in it too
    c = final["g"].outputs[0]
    assert c.finish_reason == "abort" and c.token_ids == [7, 8, 9] and c.text == text([7, 8])
    assert final["f"].outputs[0].token_ids == [7, 8, 9, 10, 11]
