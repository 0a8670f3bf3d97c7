"""Beam search (`LLM.beam_search`): the search against exhaustive enumeration over a made-up model, and on
the bundled SmolLM2 the engine's beams against the same search over transformers' logprobs, one beam
against greedy decoding, and the refusals."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from jaxserve.beam_search import BeamSearchParams, BeamSearchSequence, beam_score, beam_search
from jaxserve.outputs import Logprob
from tests.conftest import REAL_ENGINE_ARGS

EOS = 3


def _markov(tokens: list[int]) -> dict[int, float]:
    """A made-up next-token distribution over 4 tokens (3 is EOS) that depends on the last two tokens."""
    rng = np.random.default_rng(tokens[-1] * 7 + tokens[-2] * 31 + len(tokens))
    logits = rng.normal(size=4) * 2
    lp = logits - np.log(np.exp(logits).sum())
    return {t: float(lp[t]) for t in range(4)}


def _ranked(logprobs: dict[int, float]) -> dict[int, Logprob]:
    order = sorted(logprobs, key=lambda t: -logprobs[t])
    return {t: Logprob(logprobs[t], order.index(t) + 1) for t in logprobs}


def test_a_wide_enough_search_finds_the_best_sequences():
    """With room for every candidate up to the last step, the beams are the best of all sequences of up to
    `max_tokens` tokens (ending at EOS or at the limit), by cumulative logprob (length_penalty 0)."""
    prompt = [1, 2]
    params = BeamSearchParams(beam_width=9, max_tokens=2, length_penalty=0.0)
    calls = []

    def next_logprobs(lists, k):
        calls.append((len(lists), k))
        return [_ranked(_markov(t)) for t in lists]

    out = beam_search([prompt], params, max_model_len=64, eos_token_ids=[EOS], decode=str,
                      next_logprobs=next_logprobs)[0]
    every = []
    for n in (1, 2):
        for seq in itertools.product(range(4), repeat=n):
            if EOS in seq[:-1] or (n == 1 and seq[0] != EOS):
                continue
            tokens, cum = list(prompt), 0.0
            for t in seq:
                cum += _markov(tokens)[t]
                tokens.append(t)
            every.append((cum, tokens))
    every.sort(key=lambda x: -x[0])
    assert [b.tokens for b in out.sequences] == [t for _, t in every[:9]]
    assert all(math.isclose(b.cum_logprob, c) for b, (c, _) in zip(out.sequences, every, strict=False))
    assert calls == [(1, 18), (3, 18)]  # the EOS beam ended after the first step
    assert all(b.finish_reason == ("stop" if b.tokens[-1] == EOS else "length") for b in out.sequences)


def test_a_prompt_without_room_is_refused():
    for prompt in ([], list(range(64))):
        with pytest.raises(ValueError, match=f"prompt 0 has {len(prompt)} tokens; beam search needs 1 to 63"):
            beam_search([prompt], BeamSearchParams(2, 4), max_model_len=64, eos_token_ids=[EOS], decode=str,
                        next_logprobs=lambda lists, k: [])


def test_length_penalty_ranks_by_length_normalized_score():
    short = BeamSearchSequence([1, 2, EOS], cum_logprob=-1.0)
    long = BeamSearchSequence([1, 2, 5, 6, 7], cum_logprob=-1.5)
    assert beam_score(short, [EOS], 1.0) == -1.0 / 2  # the final EOS is not counted
    assert beam_score(long, [EOS], 1.0) == -1.5 / 5
    assert beam_score(long, [EOS], 0.0) == -1.5


@pytest.mark.parametrize("kwargs,words", [
    (dict(beam_width=0, max_tokens=4), "beam_width must be a positive integer"),
    (dict(beam_width=11, max_tokens=4), "beam_width must be at most 10"),
    (dict(beam_width=2, max_tokens=0), "max_tokens must be a positive integer"),
    (dict(beam_width=2, max_tokens=4, length_penalty="1"), "length_penalty must be a number"),
])
def test_refusals_name_the_parameter(kwargs, words):
    with pytest.raises(ValueError, match=words):
        BeamSearchParams(**kwargs)


@pytest.fixture(scope="module")
def llm():
    from jaxserve import LLM

    return LLM(None, **REAL_ENGINE_ARGS, progress=False)


@pytest.mark.slow
def test_engine_beams_equal_the_search_over_transformers(llm, hf_smollm, chat_prompt_ids):
    torch = pytest.importorskip("torch")
    model, _ = hf_smollm
    prompts = chat_prompt_ids[:2]
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    got = llm.beam_search(prompts, params)

    def hf_logprobs(lists, k):
        out = {}
        for n in {len(t) for t in lists}:  # a step's live beams of one prompt have one length: one batch
            rows = [i for i, t in enumerate(lists) if len(t) == n]
            with torch.no_grad():
                logits = model(torch.tensor([lists[i] for i in rows])).logits[:, -1].double()
            top = torch.topk(torch.log_softmax(logits, -1), k)
            for i, ids, vals in zip(rows, top.indices, top.values, strict=True):
                out[i] = {int(t): Logprob(float(v), r + 1) for r, (t, v) in enumerate(zip(ids, vals, strict=True))}
        return [out[i] for i in range(len(lists))]

    eos = llm.engine.eos_ids
    want = beam_search(prompts, params, max_model_len=llm.engine.max_model_len, eos_token_ids=eos,
                       decode=llm.engine.tokenizer.decode, next_logprobs=hf_logprobs)
    for g, w in zip(got, want, strict=True):
        assert len(g.sequences) == 3
        assert [b.tokens for b in g.sequences] == [b.tokens for b in w.sequences]
        for a, b in zip(g.sequences, w.sequences, strict=True):
            assert a.cum_logprob == pytest.approx(b.cum_logprob, abs=2e-3)
            assert a.text == b.text and a.finish_reason == b.finish_reason
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_integrity()

    # One beam is greedy decoding.
    from jaxserve import SamplingParams

    one = llm.beam_search(prompts, BeamSearchParams(beam_width=1, max_tokens=8, ignore_eos=True))
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0),
                          use_tqdm=False)
    for b, g in zip(one, greedy, strict=True):
        c = g.outputs[0]
        assert b.sequences[0].tokens[len(g.prompt_token_ids):] == c.token_ids
        lps = [pos[t].logprob for t, pos in zip(c.token_ids, c.logprobs, strict=True)]
        beam = b.sequences[0]
        assert [pos[t].logprob for t, pos in zip(c.token_ids, beam.logprobs, strict=True)] == pytest.approx(lps, abs=1e-4)
        assert all(pos[t].rank == 1 for t, pos in zip(c.token_ids, beam.logprobs, strict=True))


def test_llm_chat_continues_a_final_message_and_takes_documents(llm):
    """`LLM.chat(continue_final_message=True)`: the prompt ends with the final message's own text (no end of
    turn), so the model continues it; `documents` reach the template; the bundled GGUF has no sampling defaults."""
    from jaxserve import SamplingParams

    conv = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is"}]
    out = llm.chat(conv, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False, continue_final_message=True,
                   documents=[{"title": "France", "text": "Paris is the capital."}])[0]
    tok = llm.get_tokenizer()
    tail = tok.encode(" capital of France is", add_special_tokens=False)
    assert out.prompt_token_ids[-len(tail):] == tail
    assert "Paris" in out.outputs[0].text
    assert llm.get_default_sampling_params() == SamplingParams()
