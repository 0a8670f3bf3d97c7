"""A hybrid model's selective scans (`models.mamba.chunked_scan`, the Pallas backends'; `token_scan`, the XLA
backend's) and gated delta rules (`models.gated_delta.chunked_delta_scan`, `token_delta_scan`) against the
recurrences token by token in numpy, over random ragged batches. No torch: this runs on the GPU machine too
(bench/gpu_session.sh)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest


def _scan_reference(log_decay, dx, B, C, seq, slot, fresh, last, pool):
    """The recurrence token by token (numpy, float64): each sequence from zero or its slot's state, its last
    token's state written to its slot."""
    pool, h, ys, prev = np.array(pool, np.float64), None, [], None
    for t in range(len(seq)):
        if seq[t] != prev:
            h = np.zeros(pool.shape[1:]) if fresh[t] else pool[slot[t]].copy()
        h = np.exp(log_decay[t])[:, None, None] * h + dx[t][:, :, None] * B[t][:, None, :]
        ys.append(np.einsum("hpn,hn->hp", h, C[t]))
        if last[t]:
            pool[slot[t]] = h
        prev = seq[t]
    return np.stack(ys), pool


def _ragged_batch(rng, T: int, slots: int) -> tuple[np.ndarray, ...]:
    """A random ragged batch of T tokens: sequences of 1 to 150 tokens (decodes, chunks inside one chunk of 64,
    across two or three), each in its own slot and fresh or from its slot's state, then padding (each token a
    sequence of its own, fresh, in slot 0): (seq, slot, fresh, last, real) per token."""
    lens, t = [], 0
    while t < 200:
        n = int(rng.choice([1, 1, 3, 40, 90, 150]))
        lens.append(min(n, 230 - t))
        t += lens[-1]
    seq = np.concatenate([np.full(n, i) for i, n in enumerate(lens)] + [len(lens) + np.arange(T - t)])
    own = rng.permutation(np.arange(1, slots))[:len(lens)]
    slot = np.concatenate([np.full(n, own[i]) for i, n in enumerate(lens)] + [np.zeros(T - t, int)])
    fresh = np.concatenate([np.full(n, rng.random() < 0.4) for n in lens] + [np.ones(T - t, bool)])
    last = np.append(seq[1:] != seq[:-1], True)
    return seq, slot, fresh, last, seq < len(lens)


def _check(fn, args, reference, ragged, pool):
    """`fn` (jitted) over `args` and the ragged batch gives `reference`'s outputs (of real tokens) and slots."""
    seq, slot, fresh, last, real = ragged
    want_y, want_pool = reference(*args, seq, slot, fresh, last, pool)
    y, got_pool = jax.jit(fn)(*args, jnp.asarray(seq, jnp.int32), jnp.asarray(slot, jnp.int32), jnp.asarray(fresh),
                              jnp.asarray(last), jnp.asarray(pool))
    np.testing.assert_allclose(np.asarray(y)[real], want_y[real], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(got_pool)[1:], want_pool[1:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("scan", ["chunked_scan", "token_scan"])
def test_the_scans_equal_the_recurrence(scan, seed):
    """`mamba.chunked_scan` and `mamba.token_scan` over random ragged batches of 256 tokens (four chunks): the
    outputs and the slots' states of the recurrence token by token (numpy)."""
    from jaxserve.models import mamba

    rng = np.random.default_rng(seed)
    T, H, P, N, slots = 256, 3, 4, 5, 12
    ragged = _ragged_batch(rng, T, slots)
    f32 = np.float32
    args = (-rng.uniform(0.0, 0.3, (T, H)).astype(f32), rng.normal(size=(T, H, P)).astype(f32),
            rng.normal(size=(T, H, N)).astype(f32), rng.normal(size=(T, H, N)).astype(f32))
    _check(getattr(mamba, scan), args, _scan_reference, ragged, rng.normal(size=(slots, H, P, N)).astype(f32))


def _delta_reference(g, beta, q, k, v, seq, slot, fresh, last, pool):
    """The gated delta rule token by token (numpy, float64), as `_scan_reference` runs the selective scan."""
    pool, S, ys, prev = np.array(pool, np.float64), None, [], None
    for t in range(len(seq)):
        if seq[t] != prev:
            S = np.zeros(pool.shape[1:]) if fresh[t] else pool[slot[t]].copy()
        S = np.exp(g[t])[:, None, None] * S
        delta = (v[t] - np.einsum("hpn,hn->hp", S, k[t])) * beta[t][:, None]
        S = S + delta[:, :, None] * k[t][:, None, :]
        ys.append(np.einsum("hpn,hn->hp", S, q[t]))
        if last[t]:
            pool[slot[t]] = S
        prev = seq[t]
    return np.stack(ys), pool


@pytest.mark.parametrize("seed,beta_max", [(0, 1.0), (1, 1.0), (2, 1.0), (3, 2.0)])
@pytest.mark.parametrize("scan", ["chunked_delta_scan", "token_delta_scan"])
def test_the_delta_rules_equal_the_recurrence(scan, seed, beta_max):
    """`gated_delta.chunked_delta_scan` and `token_delta_scan` over random ragged batches of 256 tokens (keys of unit
    length, as the model norms them; beta in (0, 1), or (0, 2) as OLMo Hybrid doubles it): the outputs and the slots'
    states of the rule token by token."""
    from jaxserve.models import gated_delta

    rng = np.random.default_rng(seed)
    T, H, P, N, slots = 256, 3, 4, 5, 12
    ragged = _ragged_batch(rng, T, slots)
    f32 = np.float32
    k = rng.normal(size=(T, H, N))
    args = (-rng.uniform(0.0, 0.3, (T, H)).astype(f32), rng.uniform(0.0, beta_max, (T, H)).astype(f32),
            rng.normal(size=(T, H, N)).astype(f32), (k / np.linalg.norm(k, axis=-1, keepdims=True)).astype(f32),
            rng.normal(size=(T, H, P)).astype(f32))
    _check(getattr(gated_delta, scan), args, _delta_reference, ragged, rng.normal(size=(slots, H, P, N)).astype(f32))


def _mamba1_reference(log_decay, dx, B, C, seq, slot, fresh, last, pool):
    """Jamba's selective scan token by token (numpy, float64): a channel's state [N] decays by exp(a) per state dim
    and takes dt x B; its output C . state."""
    pool, h, ys, prev = np.array(pool, np.float64), None, [], None
    for t in range(len(seq)):
        if seq[t] != prev:
            h = np.zeros(pool.shape[1:]) if fresh[t] else pool[slot[t]].copy()
        h = np.exp(log_decay[t])[:, None, :] * h + dx[t][:, None, None] * B[t][None, None, :]
        ys.append(np.einsum("cpn,n->c", h, C[t]))
        if last[t]:
            pool[slot[t]] = h
        prev = seq[t]
    return np.stack(ys), pool


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("scan", ["chunked_mamba1_scan", "token_mamba1_scan"])
def test_the_mamba1_scans_equal_the_recurrence(scan, seed):
    """`mamba1.chunked_mamba1_scan` (an associative scan a chunk) and `token_mamba1_scan` over random ragged batches of
    256 tokens: the outputs and the slots' states of the recurrence token by token."""
    from jaxserve.models import mamba1

    rng = np.random.default_rng(seed)
    T, C, N, slots = 256, 6, 5, 12
    ragged = _ragged_batch(rng, T, slots)
    f32 = np.float32
    args = (-rng.uniform(0.0, 0.3, (T, C, N)).astype(f32), rng.normal(size=(T, C)).astype(f32),
            rng.normal(size=(T, N)).astype(f32), rng.normal(size=(T, N)).astype(f32))
    _check(getattr(mamba1, scan), args, _mamba1_reference, ragged, rng.normal(size=(slots, C, 1, N)).astype(f32))
