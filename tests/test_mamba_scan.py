"""A hybrid model's selective scans (`models.mamba.chunked_scan`, the Pallas backends'; `token_scan`, the XLA
backend's) against the recurrence token by token in numpy, over random ragged batches. No torch: this runs on the
GPU machine too (bench/gpu_session.sh)."""

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


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("scan", ["chunked_scan", "token_scan"])
def test_the_scans_equal_the_recurrence(scan, seed):
    """`mamba.chunked_scan` and `mamba.token_scan` over random ragged batches of 256 tokens (four chunks): sequences
    of 1 to 150 tokens (decodes, chunks inside one chunk, across two or three), each fresh or from its slot's state,
    padding after: the outputs and the slots' states of the recurrence token by token (numpy)."""
    from jaxserve.models import mamba

    rng = np.random.default_rng(seed)
    T, H, P, N, slots = 256, 3, 4, 5, 12
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
    f32 = np.float32
    args = (-rng.uniform(0.0, 0.3, (T, H)).astype(f32), rng.normal(size=(T, H, P)).astype(f32),
            rng.normal(size=(T, H, N)).astype(f32), rng.normal(size=(T, H, N)).astype(f32))
    pool = rng.normal(size=(slots, H, P, N)).astype(f32)
    want_y, want_pool = _scan_reference(*args, seq, slot, fresh, last, pool)
    y, got_pool = jax.jit(getattr(mamba, scan))(*args, jnp.asarray(seq, jnp.int32), jnp.asarray(slot, jnp.int32),
                                         jnp.asarray(fresh), jnp.asarray(last), jnp.asarray(pool))
    real = seq < len(lens)
    np.testing.assert_allclose(np.asarray(y)[real], want_y[real], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(got_pool)[1:], want_pool[1:], rtol=1e-4, atol=1e-4)
