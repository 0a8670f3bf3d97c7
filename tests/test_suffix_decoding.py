"""Suffix decoding's drafts (`engine.suffix_decoding`) against a brute-force reference of its rule: every occurrence
of each suffix of the context found by scanning the sequences themselves, the continuations counted one by one.
The engine's equivalence (the same outputs, drafts from earlier responses) is in tests/test_speculative.py."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from jaxserve.engine.request import Request
from jaxserve.engine.suffix_decoding import SuffixDecoding, TokenStore
from jaxserve.speculative_config import SpeculativeConfig


def reference(seqs: list[list[int]], pattern: list[int], k: int, depth: int, factor: float,
              min_prob: float) -> tuple[list[int], float]:
    best: tuple[list[int], float] = ([], 0.0)
    for length in range(1, min(len(pattern), depth) + 1):
        pat = pattern[-length:]
        ends = [(s, i) for s, seq in enumerate(seqs) for i in range(length - 1, len(seq))
                if seq[i - length + 1:i + 1] == pat]
        if not ends:
            break
        most = min(k, int(length * factor + 1e-6), depth - length)
        draft, prob, score = [], 1.0, 0.0
        while len(draft) < most and ends:
            nxt = Counter(seqs[s][i + 1] for s, i in ends if i + 1 < len(seqs[s]))
            if not nxt:
                break
            token, count = max(nxt.items(), key=lambda x: (x[1], -x[0]))  # (ties: the smallest id)
            prob *= count / len(ends)
            if prob < min_prob:
                break
            draft.append(token)
            score += prob
            ends = [(s, i + 1) for s, i in ends if i + 1 < len(seqs[s]) and seqs[s][i + 1] == token]
        if score > best[1]:
            best = (draft, score)
    return best


def test_a_draft_follows_what_most_matches_continue_with():
    store = TokenStore()
    for seq in ([1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [9, 2, 3, 7], [1, 2, 3, 4, 5]):
        store.extend(seq)
        store.end_sequence()
    # "1 2 3": three matches, all go on with 4 (p 1), then two of three with 5 (p 2/3).
    draft, score = store.speculate(np.array([1, 2, 3]), 8, 24, 1.0, 0.1)
    assert draft == [4, 5] and score == pytest.approx(1 + 2 / 3)
    # At most factor * (match length) drafts: "8 3" is not found, "3" is (3 of its 4 matches go on with 4): one draft.
    assert store.speculate(np.array([8, 3]), 8, 24, 1.0, 0.1) == ([4], 0.75)
    assert store.speculate(np.array([1, 2, 3]), 8, 24, 2.0, 0.7)[0] == [4]  # (2/3 < 0.7 stops it)
    # Depth 4: "1 2 3" leaves room for one draft (score 1); "2 3" for two, 4 then 5 (0.75 + 0.75 * 2/3).
    assert store.speculate(np.array([1, 2, 3]), 8, 4, 1.0, 0.1) == ([4, 5], pytest.approx(1.25))
    assert store.speculate(np.array([5]), 8, 24, 1.0, 0.1) == ([], 0.0)  # nothing follows across sequences


@pytest.mark.parametrize("vocab", [3, 6, 40])
def test_drafts_equal_the_reference(vocab):
    """Random sequences of a small vocabulary (many matches), random contexts and settings."""
    rng = np.random.default_rng(vocab)
    for trial in range(30):
        seqs = [rng.integers(0, vocab, rng.integers(1, 60)).tolist() for _ in range(rng.integers(1, 6))]
        store = TokenStore()
        for seq in seqs:
            store.extend(seq)
            store.end_sequence()
        pattern = rng.integers(0, vocab, rng.integers(1, 30)).tolist()
        k, depth = int(rng.integers(1, 12)), int(rng.integers(1, 30))
        factor, min_prob = float(rng.choice([0.5, 1.0, 2.5])), float(rng.choice([0.0, 0.1, 0.4]))
        got = store.speculate(np.asarray(pattern), k, depth, factor, min_prob)
        want = reference(seqs, pattern, k, depth, factor, min_prob)
        assert got[0] == want[0] and got[1] == pytest.approx(want[1]), trial


def test_the_cache_keeps_the_latest_responses_and_the_requests_own_tokens():
    """Proposals from a request's own tokens and the cache, the better of the two, as the reference finds them; the
    oldest responses leave the cache first (across its compaction, when they are most of it)."""
    rng = np.random.default_rng(5)
    suffix = SuffixDecoding(depth=12, max_cached_requests=3, factor=1.5, min_prob=0.05)
    finished: list[list[int]] = []
    for i in range(40):
        request = Request(f"r{i}", rng.integers(0, 5, rng.integers(1, 40)).tolist(), max_tokens=400)
        for _ in range(int(rng.integers(1, 4))):
            request.output_token_ids.extend(rng.integers(0, 5, rng.integers(1, 9)).tolist())
            tokens = request.prompt_token_ids + request.output_token_ids
            pattern = tokens[-12:]
            own = reference([tokens], pattern, 6, 12, 1.5, 0.05)
            cached = reference(finished[-3:], pattern, 6, 12, 1.5, 0.05)
            want = max([own, cached], key=lambda d: d[1])[0]
            assert suffix.propose(request, 6).tolist() == want, i
        # Long responses now and then, so the dropped ones are soon most of the store (compacted).
        request.output_token_ids.extend(rng.integers(0, 5, 700 if i % 7 == 3 else 5).tolist())
        suffix.finished(request)
        finished.append(request.output_token_ids)
    assert suffix.responses.size < sum(len(r) + 1 for r in finished)  # compacted at least once


def test_without_a_cache_only_the_requests_own_tokens():
    suffix = SuffixDecoding(max_cached_requests=0)
    done = Request("a", [1, 2, 3], max_tokens=8)
    done.output_token_ids = [4, 5, 6, 7]
    suffix.finished(done)
    assert suffix.responses.size == 0
    assert suffix.propose(Request("b", [9, 4, 5], max_tokens=8), 4).size == 0
    assert SuffixDecoding().propose(Request("c", [4, 5, 6, 4, 5], max_tokens=8), 4).tolist() == [6, 4]


def test_config():
    spec = SpeculativeConfig.parse({"method": "suffix"})
    assert spec.num_speculative_tokens == spec.suffix_decoding_max_tree_depth == 24
    assert SpeculativeConfig(method="suffix", suffix_decoding_max_tree_depth=8).num_speculative_tokens == 8
    assert SpeculativeConfig(method="ngram").num_speculative_tokens == 4
    for bad, match in [({"model": "x"}, "'suffix' drafts from tokens already seen and takes no model"),
                       ({"suffix_decoding_max_tree_depth": 0}, "max_tree_depth must be an integer >= 1"),
                       ({"suffix_decoding_max_cached_requests": -1}, "max_cached_requests must be an integer >= 0"),
                       ({"suffix_decoding_max_spec_factor": 0}, "max_spec_factor must be a positive number"),
                       ({"suffix_decoding_min_token_prob": 1.5}, r"min_token_prob must be within \[0, 1\]")]:
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig(method="suffix", **bad)


def test_drafts_from_a_predicted_output():
    """`prediction_drafts`: where the output's last tokens are found in the prediction, what follows them there (all
    `k` of it, whatever the match's length); nothing without a match or a prediction."""
    from jaxserve.engine.suffix_decoding import prediction_drafts
    from jaxserve.sampling_params import SamplingParams

    request = Request("p", [1, 2], max_tokens=50, sampling_params=SamplingParams(prediction=[5, 6, 7, 8, 9, 6, 3]))
    request.output_token_ids = [5]
    assert prediction_drafts(request, 4).tolist() == [6, 7, 8, 9]
    request.output_token_ids = [5, 6, 7, 8, 9, 6]
    assert prediction_drafts(request, 4).tolist() == [3]  # "9 6" is found once: its end
    request.output_token_ids = [4]
    assert prediction_drafts(request, 4).size == 0
    assert prediction_drafts(Request("q", [1], max_tokens=5, sampling_params=SamplingParams()), 4).size == 0
    with pytest.raises(ValueError, match="prediction must be a string or a list of token ids"):
        SamplingParams(prediction={"type": "content"})


def test_an_aborted_requests_response_is_cached_as_far_as_it_got():
    """As vLLM keeps them: a request aborted mid-answer leaves its response so far in the cache; one aborted before
    any output leaves nothing."""
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine_args import EngineArgs
    from jaxserve.sampling_params import SamplingParams
    from tests.fake_model import fake_loaded_model

    engine = LLMEngine(EngineArgs(max_num_seqs=1, max_num_batched_tokens=16, max_model_len=64, page_size=8,
                                  kv_cache_memory_bytes=2**20, warmup=False, speculative_config={"method": "suffix"}),
                       loaded=fake_loaded_model(), progress=False)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params)
    engine.add_request("waits", [9], params)  # (one sequence at a time: it waits for "a")
    while not any(len(o.outputs[0].token_ids) >= 4 for o in engine.step() if o.request_id == "a"):
        pass
    engine.abort_request("waits")
    got = engine.abort_request("a").outputs[0].token_ids
    suffix = engine.drafter.suffix
    assert len(suffix._cached) == 1
    assert suffix.responses.tokens[:len(got)].tolist() == got and len(got) >= 4
    engine.check_integrity()
