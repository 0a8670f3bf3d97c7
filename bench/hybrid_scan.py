"""Timings of a hybrid model's selective scans over a ragged batch (a Mamba-2 layer's step): `models.mamba.chunked_scan`
(the Pallas backends') at several chunk sizes against `token_scan` (one token a step: the XLA backend's), at
Granite-4.0-H-Tiny's head shapes by default (48 heads of 64 channels, a state of 128 per channel), on whatever device
JAX runs on. Two batches of 512 tokens: one prompt (fresh states), and three 160-token prompt chunks continuing
from their slots' states beside 32 decode tokens. Several input sets; each row: the largest difference from the
baseline's outputs, then per implementation the median time per call and tokens per second.
Usage: python bench/hybrid_scan.py [--heads H] [--head-dim P] [--state N] [--chunks 16,32,64] [--budget-s S]"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.gpu_kernels import timeit
from jaxserve.models.mamba import chunked_scan, token_scan

T = 512


def batch(lens: list[int], fresh: bool, H: int, P: int, N: int, seed: int) -> tuple:
    """Random inputs for sequences of `lens` tokens (in slots 1, 2, ...), starting fresh or from their slots."""
    rng = np.random.default_rng(seed)
    seq = np.repeat(np.arange(len(lens)), lens)
    f32 = jnp.float32
    return (jnp.asarray(-rng.uniform(0.0, 0.2, (T, H)), f32), jnp.asarray(rng.normal(size=(T, H, P)), f32),
            jnp.asarray(rng.normal(size=(T, H, N)), f32), jnp.asarray(rng.normal(size=(T, H, N)), f32),
            jnp.asarray(seq, jnp.int32), jnp.asarray(seq + 1, jnp.int32), jnp.full(T, fresh),
            jnp.asarray(np.append(seq[1:] != seq[:-1], True)),
            jnp.asarray(rng.normal(size=(len(lens) + 1, H, P, N)) * 0.1, f32))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", type=int, default=48)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--state", type=int, default=128)
    parser.add_argument("--chunks", default="16,32,64")
    parser.add_argument("--budget-s", type=float, default=60)
    a = parser.parse_args()
    budget = time.time() + a.budget_s
    H, P, N = a.heads, a.head_dim, a.state
    print(f"selective scan, {H} heads x {P} channels x state {N}, {T} tokens; {jax.devices()[0].device_kind}")
    fns = [("token", jax.jit(token_scan))] + [
        (f"chunk{q}", jax.jit(functools.partial(chunked_scan, chunk=int(q)))) for q in a.chunks.split(",")]
    for label, lens, fresh in (("one 512-token prompt", [T], True),
                               ("3 x 160 prompt tokens + 32 decodes", [160] * 3 + [1] * 32, False)):
        sets = [batch(lens, fresh, H, P, N, seed) for seed in range(3)]
        want = np.asarray(fns[0][1](*sets[0])[0])
        cells = [label]
        for name, fn in fns:
            if time.time() > budget:
                cells.append(f"{name}: budget spent")
                continue
            diff = float(np.max(np.abs(np.asarray(fn(*sets[0])[0]) - want)))
            sec = timeit(fn, sets)
            cells.append(f"{name}: {sec * 1e3:8.2f} ms {T / sec / 1e3:8.1f}k tok/s (max |diff| {diff:.2g})")
        print(" | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
