"""The jitted sampler against numpy references and the statistics it must have."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.engine.penalties import apply_penalties, token_counts, token_mask, update_counts
from jaxserve.engine.sampler import (
    TOP_K_CAP,
    SamplingTensors,
    _threefry_key_data,
    sample,
)
from jaxserve.outputs import Logprob, token_logprobs
from jaxserve.sampling_params import SamplingParams as SP

EOS = 2


# Each test pads its batch to the row count of its vocabulary size, so that the whole file
# compiles `sample` only a handful of times.
ROWS = {16: 4096, 512: 2048}


def tensors(params, vocab=16, steps=None, counters=None, padded=None):
    steps = steps if steps is not None else [0] * len(params)
    return SamplingTensors.from_params(
        params, steps, padded or ROWS[vocab], vocab, [EOS], request_counters=counters
    )


def pad(rows):
    rows = np.asarray(rows, np.float32)
    out = np.zeros((ROWS[rows.shape[1]], rows.shape[1]), np.float32)
    out[: len(rows)] = rows
    return jnp.asarray(out)


def run(logits, params, steps=None, counters=None, counts=None, prompt=None, k=0, mode="raw_logprobs"):
    """Sample the first len(params) rows of `logits`, padded; returns the SamplerOutput rows."""
    n, V = len(params), logits.shape[1]
    counters = counters if counters is not None else list(range(n))
    t = tensors(params, V, steps, counters)
    counts = None if counts is None else jnp.asarray(np.pad(counts, ((0, ROWS[V] - n), (0, 0))))
    prompt = None if prompt is None else jnp.asarray(np.pad(prompt, ((0, ROWS[V] - n), (0, 0))))
    out = sample(pad(logits), t, counts, prompt, num_top_logprobs=k, logprobs_mode=mode)
    return jax.tree.map(lambda a: np.asarray(a)[:n], out)


def draw(logits, params, **kw):
    """Sample every row of `logits` once; unseeded rows get distinct streams."""
    return run(logits, params, **kw).token_ids


def np_softmax(z):
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def allowed_ref(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """vLLM's filter chain in float64 over one row: the set of tokens that may be drawn."""
    p = np_softmax(np.asarray(logits, np.float64) / temperature)
    order = np.argsort(-p)
    keep = np.ones(p.shape, bool)
    if top_k > 0:
        keep[order[top_k:]] = False
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    if top_p < 1:
        qs = q[order]
        above = np.cumsum(qs) - qs  # mass strictly ranked above each token
        keep[order[above >= top_p]] = False
    if min_p > 0:
        keep &= p >= min_p * p.max()
    return keep


def test_greedy_is_argmax_and_padding_is_inert():
    logits = np.random.default_rng(0).normal(size=(ROWS[16], 16)).astype(np.float32)
    out = sample(jnp.asarray(logits), tensors([SP(temperature=0)] * 4))
    np.testing.assert_array_equal(np.asarray(out.token_ids), logits.argmax(-1))


def test_top_k_1_is_greedy():
    logits = np.random.default_rng(1).normal(size=(256, 16)).astype(np.float32) * 3
    ids = draw(logits, [SP(temperature=1.5, top_k=1)] * 256)
    np.testing.assert_array_equal(ids, logits.argmax(-1))


@pytest.mark.parametrize(
    "kw",
    [dict(top_k=3), dict(top_p=0.6), dict(min_p=0.2), dict(top_k=5, top_p=0.7, min_p=0.05)],
    ids=["top_k", "top_p", "min_p", "all"],
)
def test_filters_never_leave_the_allowed_set(kw):
    V, S = 16, 4096
    row = np.random.default_rng(2).normal(size=V).astype(np.float32) * 1.5
    ids = draw(np.tile(row, (S, 1)), [SP(temperature=0.9, **kw)] * S)
    allowed = allowed_ref(row, 0.9, **kw)
    seen = np.bincount(ids, minlength=V) > 0
    assert not np.any(seen & ~allowed), (np.flatnonzero(seen), np.flatnonzero(allowed))
    # Every allowed token has probability >= 1/V here, so 4096 draws reach each of them.
    np.testing.assert_array_equal(seen, allowed)
    assert 1 < allowed.sum() < V


def test_frequencies_match_softmax():
    V, S, temp = 16, 4096, 0.7
    row = np.random.default_rng(3).normal(size=V).astype(np.float32)
    ids = draw(np.tile(row, (S, 1)), [SP(temperature=temp)] * S)
    expected = np_softmax(row.astype(np.float64) / temp) * S
    observed = np.bincount(ids, minlength=V)
    chi2 = np.sum((observed - expected) ** 2 / expected)
    assert chi2 < 37.7, (chi2, observed, expected.round())  # 99.9% quantile, 15 degrees of freedom


def test_filtered_frequencies_are_renormalized():
    V, S = 16, 4096
    row = np.random.default_rng(4).normal(size=V).astype(np.float32)
    ids = draw(np.tile(row, (S, 1)), [SP(top_k=4)] * S)
    keep = allowed_ref(row, 1.0, top_k=4)
    p = np.where(keep, np_softmax(row.astype(np.float64)), 0)
    expected = (p / p.sum() * S)[keep]
    observed = np.bincount(ids, minlength=V)[keep]
    assert np.sum((observed - expected) ** 2 / expected) < 16.3  # 99.9%, 3 degrees of freedom


def test_wide_top_k_and_wide_nucleus_take_the_full_path():
    V, S = 512, 256
    logits = np.random.default_rng(5).normal(size=(S, V)).astype(np.float32) * 0.5  # nucleus >> cap
    params = [SP(top_k=TOP_K_CAP + 70)] * (S // 2) + [SP(top_p=0.8, top_k=400)] * (S // 2)
    ids = draw(logits, params)
    for i in range(S):
        allowed = allowed_ref(logits[i], 1.0, top_k=params[i].top_k, top_p=params[i].top_p)
        assert allowed[ids[i]], (i, ids[i])
    assert len(set(ids.tolist())) > 100  # draws spread over a wide set, not the top few


@pytest.mark.parametrize("kw", [dict(top_k=300), dict(top_p=0.5), dict(top_k=200, top_p=0.9)])
def test_full_path_cuts_where_the_reference_does(kw):
    V, S = 512, 2048
    row = np.random.default_rng(6).normal(size=V).astype(np.float32)
    ids = draw(np.tile(row, (S, 1)), [SP(**kw)] * S)
    allowed = allowed_ref(row, 1.0, **kw)
    seen = np.bincount(ids, minlength=V) > 0
    assert not np.any(seen & ~allowed)
    # The least likely allowed tokens are still drawn: the cut is not too tight either.
    assert seen[allowed].mean() > 0.9


def test_fast_rows_do_not_change_when_the_batch_takes_the_full_path():
    V = 512
    rng = np.random.default_rng(7)
    logits = np.stack([rng.normal(size=V) * 4, rng.normal(size=V) * 0.3]).astype(np.float32)
    mine = SP(temperature=0.8, top_p=0.9, seed=99)
    tokens = []
    for step in range(6):
        alone = draw(logits, [mine, mine], steps=[step] * 2)
        mixed = draw(logits, [mine, SP(top_p=0.95, seed=1)], steps=[step] * 2)  # row 1 needs the full path
        assert alone[0] == mixed[0]
        tokens.append(alone[0])
    assert len(set(tokens)) > 1


def test_same_seed_same_tokens_whatever_the_batch():
    V = 16
    rng = np.random.default_rng(8)
    row = rng.normal(size=V).astype(np.float32)
    mine = SP(temperature=1.0, top_p=0.95, seed=1234)
    others = [SP(temperature=0.5, top_k=5), SP(temperature=0), SP(seed=7), SP(min_p=0.1)]

    def tokens(batch, where, padded):
        logits = rng.normal(size=(padded, V)).astype(np.float32)
        logits[where] = row
        out = []
        for step in range(12):
            t = tensors(batch, V, [step] * len(batch), [100 + i for i in range(len(batch))], padded)
            out.append(int(sample(jnp.asarray(logits), t).token_ids[where]))
        return out

    first = tokens([mine] + others[:1], 0, ROWS[V])
    assert tokens(others[:3] + [mine], 3, ROWS[V]) == first
    assert tokens(others + [mine], 4, ROWS[V]) == first
    assert len(set(first)) > 3  # it is sampling, not a constant
    assert tokens([SP(temperature=1.0, top_p=0.95, seed=4321)], 0, ROWS[V]) != first


def test_seed_key_is_jax_prngkey():
    for seed in (0, 1, 42, 2**31 - 1, 2**32 - 1):
        np.testing.assert_array_equal(_threefry_key_data(seed), jax.random.key_data(jax.random.PRNGKey(seed)))


def test_unseeded_rows_differ_by_request_counter():
    S = 256
    logits = np.zeros((S, 16), np.float32)
    a = draw(logits, [SP()] * S)
    b = draw(logits, [SP()] * S, counters=[1000 + i for i in range(S)])
    assert len(set(a.tolist())) == 16 and np.mean(a == b) < 0.2


def np_penalties(logits, counts, prompt, rep, pres, freq):
    out = logits.astype(np.float64).copy()
    for i in range(out.shape[0]):
        seen = (counts[i] > 0) | prompt[i]
        pos = out[i] > 0
        out[i] = np.where(seen & pos, out[i] / rep[i], np.where(seen, out[i] * rep[i], out[i]))
        out[i] -= freq[i] * counts[i] + pres[i] * (counts[i] > 0)
    return out


def test_penalties_match_numpy():
    V = 32
    rng = np.random.default_rng(9)
    logits = rng.normal(size=(4, V)).astype(np.float32) * 2
    params = [
        SP(repetition_penalty=1.3),
        SP(presence_penalty=0.7, frequency_penalty=0.4),
        SP(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=1.5),
        SP(),
    ]
    outputs = [rng.integers(0, V, size=n).tolist() for n in (6, 9, 12, 3)]
    prompts = [rng.integers(0, V, size=5).tolist() for _ in range(4)]
    counts, prompt = token_counts(outputs, 4, V), token_mask(prompts, 4, V)
    t = tensors(params, V, padded=4)
    got = apply_penalties(jnp.asarray(logits), t, jnp.asarray(counts), jnp.asarray(prompt))
    want = np_penalties(logits, counts, prompt, t.repetition_penalty, t.presence_penalty, t.frequency_penalty)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(want[:3], logits[:3])


def test_penalties_steer_greedy_and_keep_raw_logprobs():
    V = 16
    logits = np.zeros((3, V), np.float32)
    logits[:, 5], logits[:, 6], logits[:, 7] = 3.0, 2.5, 2.0
    counts = token_counts([[5, 5], [5, 5], []], 3, V)
    prompt = token_mask([[], [], [5, 6]], 3, V)
    params = [
        SP(temperature=0, frequency_penalty=0.5),
        SP(temperature=0),
        SP(temperature=0, repetition_penalty=2.0),
    ]
    out = run(logits, params, counts=counts, prompt=prompt, k=5)
    assert out.token_ids.tolist() == [6, 5, 7]
    raw = np.log(np_softmax(logits[0].astype(np.float64)))
    np.testing.assert_allclose(out.logprobs, raw[[6, 5, 7]], rtol=1e-5)
    assert out.ranks.tolist() == [2, 1, 3]


def test_min_tokens_suppresses_eos_and_stop_ids():
    V = 16
    logits = np.zeros((4, V), np.float32)
    logits[:, EOS], logits[:, 9], logits[:, 4] = 5.0, 4.0, 3.0
    params = [
        SP(temperature=0, min_tokens=3, stop_token_ids=[9]),
        SP(temperature=0, min_tokens=3),
        SP(temperature=0, min_tokens=3, ignore_eos=True),
    ]
    assert draw(logits[:3], params, steps=[0] * 3).tolist() == [4, 9, EOS]
    assert draw(logits[:3], params, steps=[2] * 3).tolist() == [4, 9, EOS]
    assert draw(logits[:3], params, steps=[3] * 3).tolist() == [EOS, EOS, EOS]
    # Random rows never draw a suppressed id before min_tokens.
    S = 1024
    ids = draw(
        np.tile(logits[0], (S, 1)), [SP(temperature=0.5, min_tokens=3, stop_token_ids=[9])] * S, steps=[1] * S
    )
    assert not np.isin(ids, [EOS, 9]).any() and (ids == 4).mean() > 0.5


def test_logit_bias_steers_greedy_and_random_rows_and_keeps_raw_logprobs():
    V = 16
    logits = np.zeros((5, V), np.float32)
    logits[:, 5], logits[:, 6], logits[:, 7] = 3.0, 2.5, 2.0
    params = [
        SP(temperature=0, logit_bias={7: 1.5}),  # 2.0 + 1.5 beats 3.0
        SP(temperature=0, logit_bias={5: -100}),  # the top token banned: the next one
        SP(temperature=0),  # no bias: the same batch leaves it alone
        SP(temperature=0, logit_bias={5: -1.0, 6: -1.0, 7: 0.4}),  # several entries in one row
        SP(temperature=0, min_tokens=2, logit_bias={EOS: 100}),  # the min_tokens mask beats any bias
    ]
    out = run(logits, params, steps=[0] * 5, k=3)
    assert out.token_ids[:4].tolist() == [7, 6, 5, 7]
    assert out.token_ids[4] != EOS
    assert draw(logits[4:], params[4:], steps=[2]).tolist() == [EOS]
    raw = np.log(np_softmax(logits[0].astype(np.float64)))
    np.testing.assert_allclose(out.logprobs[:4], raw[[7, 6, 5, 7]], rtol=1e-5)  # reported before the bias
    assert out.top_ids[0].tolist() == [5, 6, 7]
    # A random row draws from the biased distribution: +100 on one token all but forces it, -100 bans.
    S = 1024
    ids = draw(np.tile(logits[0], (S, 1)), [SP(temperature=1.0, logit_bias={11: 100, 5: -100})] * S)
    assert (ids == 11).all()
    ids = draw(np.tile(logits[0], (S, 1)), [SP(temperature=1.0, logit_bias={5: -100})] * S)
    assert not (ids == 5).any() and (ids == 6).mean() > 0.2


def test_logit_bias_comes_before_the_penalties():
    """vLLM's order: bias the raw logits, then penalize. With a repetition penalty of 2 on a seen token
    whose logit is 3, a bias of -4 makes it -1, penalized to -2 (penalizing first: 1.5 - 4 = -2.5)."""
    V = 16
    logits = np.zeros((1, V), np.float32)
    logits[0, 5] = 3.0
    logits[0, 6] = -2.2  # between the two orders' results for token 5
    logits[0, 7] = -2.1
    logits[0, [i for i in range(V) if i not in (5, 6, 7)]] = -10.0
    prompt = token_mask([[5]], 1, V)
    out = run(logits, [SP(temperature=0, repetition_penalty=2.0, logit_bias={5: -4.0, 7: -0.05})], prompt=prompt)
    assert out.token_ids.tolist() == [5]  # -2.0 > -2.15 > -2.2; penalizing first would pick 7


def test_advance_moves_past_min_tokens_on_device():
    logits = np.zeros((ROWS[16], 16), np.float32)
    logits[:, EOS] = 5.0
    t = jax.device_put(tensors([SP(temperature=0, min_tokens=2)]))
    firsts = []
    for _ in range(3):
        firsts.append(int(sample(jnp.asarray(logits), t).token_ids[0]))
        t = t.advance()
    assert firsts[0] != EOS and firsts[1] != EOS and firsts[2] == EOS


def test_logprobs_are_raw_log_softmax_with_sorted_top():
    V, S, k = 16, 8, 5
    logits = np.random.default_rng(10).normal(size=(S, V)).astype(np.float32) * 2
    params = [SP(temperature=0.6, top_k=10, repetition_penalty=1.5), SP(temperature=0)] * 4
    out = run(
        logits, params, counts=token_counts([[1, 2, 3]] * S, S, V), prompt=token_mask([[4]] * S, S, V), k=k
    )
    ref = np.log(np_softmax(logits.astype(np.float64)))
    ids = out.token_ids
    np.testing.assert_allclose(out.logprobs, ref[np.arange(S), ids], atol=1e-5)
    assert out.top_logprobs.shape == (S, k) and np.all(np.diff(out.top_logprobs, axis=-1) <= 0)
    np.testing.assert_allclose(out.top_logprobs, np.sort(ref, -1)[:, ::-1][:, :k], atol=1e-5)
    np.testing.assert_array_equal(out.top_ids, np.argsort(-ref, -1)[:, :k])
    np.testing.assert_array_equal(out.ranks, 1 + (ref > ref[np.arange(S), ids][:, None]).sum(-1))
    entry = token_logprobs(ids[0], out.logprobs[0], out.ranks[0], out.top_ids[0], out.top_logprobs[0])
    assert list(entry)[0] == ids[0] and len(entry) in (k, k + 1)
    assert entry[int(out.top_ids[0, 0])] == Logprob(float(out.top_logprobs[0, 0]), 1)


def test_logprobs_modes_report_the_distribution_the_token_was_drawn_from():
    """vLLM's --logprobs-mode: raw or processed (bias, temperature, top-k/top-p/min-p: dropped tokens -inf),
    as logprobs or logits; the tokens drawn never change."""
    V, k = 16, 8
    logits = np.random.default_rng(12).normal(size=(4, V)).astype(np.float32) * 2
    params = [SP(temperature=0.7, top_k=5, seed=1), SP(temperature=1.3, top_p=0.6, seed=2),
              SP(temperature=0.9, min_p=0.2, seed=3), SP(temperature=0, logit_bias={3: 4.0})]
    biased = logits.astype(np.float64).copy()
    biased[3, 3] += 4.0
    processed = np.stack([np.where(allowed_ref(logits[i], p.temperature, p.top_k, p.top_p, p.min_p),
                                   logits[i] / p.temperature, -np.inf) for i, p in enumerate(params[:3])] + [biased[3]])
    want = {"raw_logprobs": np.log(np_softmax(logits.astype(np.float64))), "raw_logits": logits,
            "processed_logits": processed, "processed_logprobs": processed - np.log(np.exp(processed).sum(-1))[:, None]}
    tokens = run(logits, params).token_ids
    for mode, ref in want.items():
        out = run(logits, params, k=k, mode=mode)
        np.testing.assert_array_equal(out.token_ids, tokens)
        chosen = ref[np.arange(4), tokens]
        np.testing.assert_allclose(out.logprobs, chosen, rtol=1e-5, atol=1e-5, err_msg=mode)
        np.testing.assert_allclose(out.top_logprobs, np.sort(ref, -1)[:, ::-1][:, :k], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(out.ranks, 1 + (ref > chosen[:, None]).sum(-1))
    assert np.isneginf(run(logits, params, k=k, mode="processed_logprobs").top_logprobs[0, 5:]).all(), "top-5"


def test_one_compilation_per_shape():
    logits = pad(np.random.default_rng(11).normal(size=(8, 16)))
    variants = [
        [SP(temperature=0)] * 3,
        [SP(temperature=0.3, top_k=7, seed=1), SP(top_p=0.5, min_p=0.1)],
        [SP(temperature=2.0, repetition_penalty=1.2, min_tokens=4, stop_token_ids=[3, 4])] * 8,
    ]
    sample(logits, tensors(variants[0]))
    before = sample._cache_size()
    for params in variants:
        out = sample(logits, tensors(params, steps=[5] * len(params)))
    assert sample._cache_size() == before
    assert out.top_ids.shape == (ROWS[16], 0)


def test_update_counts_and_host_builders():
    counts = jnp.zeros((3, 8), jnp.int32)
    counts = update_counts(counts, jnp.array([1, 7, -1]))
    counts = update_counts(counts, jnp.array([1, 0, -1]))
    want = token_counts([[1, 1], [7, 0], []], 3, 8)
    np.testing.assert_array_equal(np.asarray(counts), want)
    assert want[0, 1] == 2 and token_mask([[1, 1]], 2, 8).sum() == 1


def test_from_params_pads_and_checks():
    t = SamplingTensors.from_params([SP(temperature=0.5, seed=3, min_tokens=2)], [0], 4, 64, [2, 5])
    assert t.temperature.shape == (4,) and t.stop_ids.shape == (4, 8)
    assert t.greedy.tolist() == [False, True, True, True] and t.seeded.tolist() == [True, False, False, False]
    assert t.stop_ids[0, :2].tolist() == [2, 5] and (t.stop_ids[1:] == -1).all()
    wide = SamplingTensors.from_params(
        [SP(min_tokens=1, stop_token_ids=list(range(10, 20)))], [0], 1, 64, [2]
    )
    assert wide.stop_ids.shape == (1, 16)
    with pytest.raises(ValueError, match="do not fit"):
        SamplingTensors.from_params([SP()] * 3, [0] * 3, 2, 64, [2])


def _bitmask(rows_allowed, S, V):
    """An int32 bitmask [S, ceil(V / 32)] allowing each row's listed token ids (other rows: all)."""
    bm = np.full((S, (V + 31) // 32), -1, np.int32)
    for i, ids in enumerate(rows_allowed):
        bits = np.zeros(bm.shape[1] * 32, np.uint8)
        bits[list(ids)] = 1
        bm[i] = np.packbits(bits, bitorder="little").view(np.int32)
    return bm


def test_grammar_bitmask_limits_constrained_rows_only():
    """Constrained rows draw only allowed tokens, greedy or random (ids on both sides of a 32-bit word and
    the sign bit); an unconstrained row in the same batch samples exactly as without any mask."""
    V, S = 512, ROWS[512]
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, V)).astype(np.float32) * 3
    allowed = [{31, 32, 200, 511}, {5}, set(range(64, 96)), set()]
    params = [SP(temperature=0), SP(temperature=1.0), SP(temperature=0.7, top_k=20), SP(temperature=1.0)]
    bm = _bitmask(allowed[:3], S, V)
    free = None
    for step in range(40):
        t = SamplingTensors.from_params(params, [step] * 4, S, V, [EOS], request_counters=[0, 1, 2, 3],
                                        token_bitmask=bm, constrained=[True, True, True, False])
        got = np.asarray(sample(pad(logits), t).token_ids)[:4]
        plain = np.asarray(sample(pad(logits), tensors(params, V, [step] * 4, [0, 1, 2, 3])).token_ids)[:4]
        assert got[0] == max(allowed[0], key=lambda i: logits[0, i]), "greedy: the best allowed token"
        assert got[1] == 5 and got[2] in allowed[2]
        assert got[3] == plain[3], "an unconstrained row is untouched"
        free = plain
    assert free is not None and any(free[i] not in allowed[i] for i in range(3)), "the mask did something"


def test_from_params_checks_the_bitmask():
    with pytest.raises(ValueError, match="token_bitmask must be int32 of shape"):
        SamplingTensors.from_params([SP()], [0], 4, 64, [2], token_bitmask=np.zeros((4, 3), np.int32),
                                    constrained=[True])
    t = SamplingTensors.from_params([SP()], [0], 4, 64, [2])
    assert t.token_bitmask.shape == (4, 2) and (t.token_bitmask == -1).all() and not t.constrained.any()


def test_exponential_noise_is_never_zero():
    """Every hash value maps strictly inside (0, 1): a zero noise would let its token win any draw."""
    from jaxserve.engine.sampling_noise import open_unit

    u = np.asarray(open_unit(jnp.array([0, 1, 511, 512, 2**31, 2**32 - 513, 2**32 - 1], jnp.uint32)))
    assert (u > 0).all() and (u < 1).all() and np.isfinite(-np.log(u)).all() and (-np.log(u) > 0).all()


def test_a_lone_allowed_token_is_drawn_at_a_full_vocabulary():
    """SmolLM2's vocabulary, the seed and step whose noise once hit zero at token 44305: with one
    token allowed, a random row draws that token."""
    V = 49152
    logits = (np.random.default_rng(0).normal(size=(1, V)) * 5).astype(np.float32)
    bits = np.zeros(V, np.uint8)
    bits[4061] = 1
    bm = np.packbits(bits, bitorder="little").view(np.int32)[None]
    t = SamplingTensors.from_params([SP(temperature=0.8, seed=8)], [12], 1, V, [EOS], token_bitmask=bm,
                                    constrained=[True])
    assert int(sample(jnp.asarray(logits), t).token_ids[0]) == 4061
