"""Engine equivalences on the real SmolLM2: batched = alone, chunked, prefix hit, preemption, seeds."""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re

import pytest

from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine_args import EngineArgs
from jaxserve.models.inputs import KVCache
from jaxserve.sampling_params import SamplingParams
from jaxserve.structured_outputs import StructuredOutputsParams as SO
from tests.conftest import REAL_ENGINE_ARGS

pytestmark = pytest.mark.slow

SUBJECTS = ["the moon", "volcanoes", "honey bees", "the Roman empire", "prime numbers", "jazz music", "glaciers",
            "the internet"]
ASKS = ["Tell me one fact about {}.", "Why do people study {}?", "Write a short poem about {}.",
        "Explain {} to a child.", "What is surprising about {}?", "Give two keywords for {}.",
        "Summarize {} in five words.", "Is {} important? Answer briefly."]


def chat_prompts(tok, n: int = 40) -> list[list[int]]:
    prompts = []
    for i in range(n):
        ask = ASKS[i % len(ASKS)].format(SUBJECTS[(i // len(ASKS)) % len(SUBJECTS)])
        prompts.append(tok.encode_chat([{"role": "user", "content": ask}]))
    return prompts


@pytest.fixture(scope="module")
def engine(smollm_f32) -> LLMEngine:
    from jaxserve.engine.model_loading import LoadedModel

    cfg, params = smollm_f32
    from jaxserve.loader import bundled_model_path
    from jaxserve.tokenizer import Tokenizer

    path = bundled_model_path()
    import jax.numpy as jnp

    loaded = LoadedModel(path, "SmolLM2-135M-Instruct", cfg, params, Tokenizer.from_gguf(path), jnp.float32, 0.0)
    args = EngineArgs(**REAL_ENGINE_ARGS)
    assert args.kv_cache_memory_bytes == 64 * KVCache.bytes_per_page(cfg, 16, jnp.float32)
    return LLMEngine(args, loaded=loaded, progress=False)


def serve(engine: LLMEngine, prompts, params) -> list:
    outs = serve_unchecked(engine, prompts, params)
    engine.check_integrity()
    return outs


def serve_unchecked(engine: LLMEngine, prompts, params) -> list:
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    ids = [f"q{random.random()}" for _ in prompts]
    for rid, p, sp in zip(ids, prompts, params, strict=False):
        engine.add_request(rid, p, sp)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[rid] for rid in ids]


def pool_is_full(engine: LLMEngine) -> bool:
    engine.reset_prefix_cache()
    pool = engine.scheduler.pool
    return pool.num_free == pool.num_usable_pages


GREEDY = SamplingParams(temperature=0, max_tokens=10)
ALONE = 20  # the prompts also served alone (every ask, three subjects); all 40 are batched


@pytest.fixture(scope="module")
def alone(engine):
    """(the 40 prompts, the greedy tokens of the first ALONE, each served alone)."""
    prompts = chat_prompts(engine.tokenizer)
    engine.reset_prefix_cache()
    outs = []
    for p in prompts[:ALONE]:
        outs.append(serve(engine, [p], GREEDY)[0].outputs[0].token_ids)
        engine.reset_prefix_cache()  # each one computes its whole prompt
    return prompts, outs


def test_batched_equals_alone(engine, alone):
    """All 40 prompts at once (more than `max_num_seqs`, and more tokens than the pool's 64 pages hold): those also
    served alone give their tokens."""
    prompts, expected = alone
    got = [o.outputs[0].token_ids for o in serve(engine, prompts, GREEDY)]
    mismatches = [i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b]
    assert len(got) == 40 and len(expected) == ALONE
    assert not mismatches, f"{len(mismatches)} of {ALONE} differ, e.g. #{mismatches[0]}"
    assert engine.stats().compilations_after_warmup == 0
    assert pool_is_full(engine)


def test_preemption_changes_no_token(engine, alone):
    prompts, _ = alone
    long = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    subset = prompts[::7]
    # The same requests together with pages to spare (batched equals alone: test_batched_equals_alone).
    engine.reset_prefix_cache()
    before = engine.num_preemptions
    expected = [o.outputs[0].token_ids for o in serve(engine, subset, long)]
    assert engine.num_preemptions == before
    engine.reset_prefix_cache()
    # Memory pressure: hold all but 15 pages, so 6 requests needing ~4 pages each must preempt.
    pool = engine.scheduler.pool
    held = pool.allocate(pool.num_free - 15)
    try:
        got = [o.outputs[0].token_ids for o in serve_unchecked(engine, subset, long)]
    finally:
        pool.decref(held)
    assert engine.num_preemptions > before, "the 15 free pages should have forced preemptions"
    assert got == expected
    assert pool_is_full(engine)


def test_chunked_prefill_equals_whole(engine, alone):
    prompts, expected = alone
    sched = engine.scheduler
    original = sched.config
    sched.config = dataclasses.replace(original, long_prefill_token_threshold=16)
    try:
        got = [o.outputs[0].token_ids for o in serve(engine, prompts[:16], GREEDY)]
    finally:
        sched.config = original
    assert got == expected[:16]
    assert pool_is_full(engine)


def test_the_cpu_default_unrolled_layers_equal_the_scanned(engine, alone):
    """The CPU's default layer loop (each layer compiled on its own, fused projections) serves the tokens of
    the suite's engines, which scan one compiled layer; in 16-token chunks, a sequence at a time."""
    args = EngineArgs(**{**REAL_ENGINE_ARGS, "layer_loop": "auto", "max_num_seqs": 1, "max_num_batched_tokens": 16,
                         "kv_cache_memory_bytes": 16 << 20, "warmup": False})
    unrolled = LLMEngine(args, loaded=engine.model, progress=False)
    assert engine.runner.cfg.layer_loop == "scan" and unrolled.runner.cfg.layer_loop == "unroll"
    assert isinstance(unrolled.runner.params.layers, tuple)
    prompts, expected = alone
    assert [o.outputs[0].token_ids for o in serve(unrolled, prompts[:4], GREEDY)] == expected[:4]
    assert pool_is_full(unrolled)


def test_layer_loop_from_the_command_line_and_refused_by_name():
    ns = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(["--layer-loop", "scan"])
    assert EngineArgs.from_cli_args(ns).layer_loop == "scan" and EngineArgs().layer_loop == "auto"
    with pytest.raises(ValueError, match="layer_loop must be auto, scan or unroll, got 'loop'"):
        EngineArgs(layer_loop="loop")


def test_prefix_hit_equals_miss(engine, alone):
    prompts, expected = alone
    engine.reset_prefix_cache()
    first = serve(engine, [prompts[5]], GREEDY)[0]
    second = serve(engine, [prompts[5]], GREEDY)[0]
    assert first.metrics.num_cached_tokens == 0
    assert second.metrics.num_cached_tokens >= 16 * ((len(prompts[5]) - 1) // 16)
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == expected[5]
    assert pool_is_full(engine)


def test_seeded_sampling_same_alone_and_batched(engine, alone):
    prompts, _ = alone
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=10)
    other = SamplingParams(temperature=1.0, max_tokens=10)
    solo = serve(engine, [prompts[3]], seeded)[0].outputs[0].token_ids
    batch = serve(engine, [prompts[1], prompts[3], prompts[7]], [other, seeded, other])
    assert batch[1].outputs[0].token_ids == solo
    again = serve(engine, [prompts[3]], dataclasses.replace(seeded, seed=99))[0].outputs[0].token_ids
    assert again != solo  # a different seed draws differently (fails only by a 1e-10 coincidence)


def test_no_compilation_on_a_random_workload(engine):
    rng = random.Random(7)
    vocab = engine.model.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.choice([1, 15, 16, 17, 60, 130, 240]))]
               for _ in range(20)]
    params = [SamplingParams(temperature=rng.choice([0, 0.8]), max_tokens=rng.randint(1, 9),
                             logprobs=rng.choice([None, 3]), repetition_penalty=rng.choice([1.0, 1.2]))
              for _ in prompts]
    outs = serve(engine, prompts, params)
    assert all(o.finished for o in outs)
    assert engine.stats().compilations_after_warmup == 0
    assert pool_is_full(engine)


CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                         "country": {"type": "string", "maxLength": 16}},
        "required": ["city", "country"], "additionalProperties": False}


def _valid_city(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"city", "country"} and all(isinstance(v, str) and len(v) <= 16 for v in value.values()))


def test_structured_outputs_hold_and_leave_the_batch_unchanged(engine, alone):
    """JSON schema, choice, regex and a GBNF grammar, greedy and seeded-random (n=3), served in one
    batch with unconstrained requests; the decode loop runs 4 steps per call, so this also covers
    the one-step loops a grammar forces. Each constrained output ends ("stop") as its grammar
    completes; the unconstrained ones equal their outputs served alone."""
    prompts, expected = alone
    tok = engine.tokenizer
    ask = [tok.encode_chat([{"role": "user", "content": q}]) for q in (
        "Which city is the capital of France? Reply in JSON.", "Is the sky blue?",
        "How many legs does a spider have?", "Name a primary color.")]
    constrained = [
        (SO(json=CITY), _valid_city),
        (SO(choice=["yes", "no", "maybe"]), lambda t: t in ("yes", "no", "maybe")),
        (SO(regex=r"[0-9]{1,2} legs"), lambda t: re.fullmatch(r"[0-9]{1,2} legs", t) is not None),
        (SO(grammar='root ::= "The color is " ("red" | "blue" | "yellow") "."'),
         lambda t: re.fullmatch(r"The color is (red|blue|yellow)\.", t) is not None),
    ]
    params = [SamplingParams(temperature=0, max_tokens=48, structured_outputs=so) for so, _ in constrained]
    params.append(SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=48, structured_outputs=SO(json=CITY)))
    free = list(range(0, ALONE, 3))
    outs = serve(engine, ask + [ask[0]] + [prompts[i] for i in free], params + [GREEDY] * len(free))
    for out, (_, check) in zip(outs[:4], constrained, strict=False):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and check(c.text), (c.text, c.finish_reason)
    assert all(c.finish_reason == "stop" and _valid_city(c.text) for c in outs[4].outputs)
    assert len({c.text for c in outs[4].outputs}) > 1, "three seeded draws should not all agree"
    assert [o.outputs[0].token_ids for o in outs[5:]] == [expected[i] for i in free]
    assert engine.stats().compilations_after_warmup == 0
    assert pool_is_full(engine)


def test_a_constraint_after_reasoning_holds_from_the_answer(engine, alone):
    """A constraint deferred to a reasoning model's answer (`after_reasoning`, as the server sets it from its
    reasoning parser): SmolLM2 never writes the end marker, so its reply stays free and equals the unconstrained
    one; after a prompt that ends its thoughts (the marker last), the JSON schema holds from the first token."""
    prompts, expected = alone
    thoughts = ((), ("</think>",), True)  # reasoning from the first token, to "</think>" (several tokens here)
    deferred = dataclasses.replace(GREEDY, structured_outputs=SO(json=CITY, after_reasoning=thoughts))
    tok = engine.tokenizer
    ended = tok.encode_chat([{"role": "user", "content": "Which city is the capital of France?"}]) + tok.encode(
        "</think>", add_special_tokens=False)
    now = SamplingParams(temperature=0, max_tokens=48, structured_outputs=SO(json=CITY, after_reasoning=thoughts))
    free, answer = serve(engine, [prompts[0], ended], [deferred, now])
    assert free.outputs[0].token_ids == expected[0]
    assert answer.outputs[0].finish_reason == "stop" and _valid_city(answer.outputs[0].text), answer.outputs[0].text
    assert pool_is_full(engine)


def test_bad_words_and_allowed_ids_on_a_real_vocabulary(engine, alone):
    """SmolLM2 answers "Paris"; with "Paris" a bad word (its byte-level BPE forms, " Paris" among them) it never
    writes it, and with the allowed ids those of " Lyon" and "." it writes only them; batched with free requests
    that come out as alone."""
    prompts, expected = alone
    tok = engine.tokenizer
    ask = tok.encode_chat([{"role": "user", "content": "What is the capital of France? Answer in one word."}])
    free = serve(engine, [ask], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    assert "Paris" in free
    allowed = tok.encode(" Lyon.", add_special_tokens=False)
    outs = serve(engine, [ask, ask, prompts[0]], [
        SamplingParams(temperature=0, max_tokens=8, bad_words=["Paris"]),
        SamplingParams(temperature=0, max_tokens=6, allowed_token_ids=allowed), GREEDY])
    assert "Paris" not in outs[0].outputs[0].text
    assert set(outs[1].outputs[0].token_ids) <= set(allowed) and "Lyon" in outs[1].outputs[0].text
    assert outs[2].outputs[0].token_ids == expected[0]


def test_a_bad_grammar_is_refused_before_it_is_queued(engine):
    with pytest.raises(ValueError, match="structured_outputs.regex is invalid"):
        SamplingParams(structured_outputs=SO(regex="(unclosed"))
    before = engine.num_requests
    ok = serve(engine, [[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3,
                                                   structured_outputs=SO(choice=["alpha", "beta"])))
    assert ok[0].outputs[0].text in ("alpha", "beta") and engine.num_requests == before


def test_prompt_logprobs_match_transformers(engine, hf_smollm):
    """Each prompt token's logprob (and the top 3 at each position) equals transformers' log_softmax;
    the same whole, in 16-token chunks, and with the prompt already cached (it is computed anyway)."""
    import numpy as np
    import torch

    model, _ = hf_smollm
    prompts = chat_prompts(engine.tokenizer, 3)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    whole = serve(engine, prompts, params)
    again = serve(engine, prompts, params)
    sched = engine.scheduler
    original = sched.config
    sched.config = dataclasses.replace(original, long_prefill_token_threshold=16)
    try:
        chunked = serve(engine, prompts, params)
    finally:
        sched.config = original
    for ids, a, b, c in zip(prompts, whole, again, chunked, strict=True):
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1).numpy()
        plp = a.prompt_logprobs
        assert plp[0] is None and len(plp) == len(ids)
        got = np.array([plp[p][ids[p]].logprob for p in range(1, len(ids))])
        np.testing.assert_allclose(got, ref[np.arange(len(ids) - 1), ids[1:]], atol=2e-4)
        for p in range(1, len(ids)):
            top = sorted((e.rank, t, e.logprob) for t, e in plp[p].items() if e.rank <= 3)
            assert [r for r, _, _ in top][:3] == [1, 2, 3]
            np.testing.assert_allclose([lp for _, _, lp in top[:3]], np.sort(ref[p - 1])[::-1][:3], atol=2e-4)
        assert b.metrics.num_cached_tokens == 0, "a prompt-logprobs request computes its whole prompt"
        for other in (b, c):
            assert [other.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))] == pytest.approx(got,
                                                                                                          abs=1e-4)
    assert engine.stats().compilations_after_warmup == 0
    assert pool_is_full(engine)
