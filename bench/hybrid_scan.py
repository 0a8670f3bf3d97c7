"""Timings of a hybrid model's selective scans over a ragged batch (a Mamba-2 layer's step): `models.mamba.chunked_scan`
(the Pallas backends') at several chunk sizes against `token_scan` (one token a step: the XLA backend's), at
Granite-4.0-H-Tiny's head shapes by default (48 heads of 64 channels, a state of 128 per channel), on whatever device
JAX runs on; with `--rule delta`, a Gated DeltaNet layer's (`models.gated_delta.chunked_delta_scan` against
`token_delta_scan`), at Qwen3-Next's shapes by default (32 value heads of 128 dims, keys of 128). Two batches of 512
tokens: one prompt (fresh states), and three 160-token prompt chunks continuing from their slots' states beside 32
decode tokens. Several input sets; each row: the largest difference from the baseline's outputs, then per
implementation the median time per call and tokens per second.
Usage: python bench/hybrid_scan.py [--rule mamba|delta] [--heads H] [--head-dim P] [--state N] [--chunks 16,32,64]
[--budget-s S]"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.gpu_kernels import timeit
from jaxserve.models.gated_delta import chunked_delta_scan, token_delta_scan
from jaxserve.models.mamba import chunked_scan, token_scan

T = 512


def batch(lens: list[int], fresh: bool, H: int, P: int, N: int, seed: int, delta: bool = False) -> tuple:
    """Random inputs for sequences of `lens` tokens (in slots 1, 2, ...), starting fresh or from their slots (the
    delta rule's: log decay, beta, q, unit keys, v)."""
    rng = np.random.default_rng(seed)
    seq = np.repeat(np.arange(len(lens)), lens)
    f32 = jnp.float32
    if delta:
        k = rng.normal(size=(T, H, N))
        rule = (jnp.asarray(-rng.uniform(0.0, 0.2, (T, H)), f32), jnp.asarray(rng.uniform(0, 1, (T, H)), f32),
                jnp.asarray(rng.normal(size=(T, H, N)) / N**0.5, f32),
                jnp.asarray(k / np.linalg.norm(k, axis=-1, keepdims=True), f32), jnp.asarray(rng.normal(size=(T, H, P)), f32))
    else:
        rule = (jnp.asarray(-rng.uniform(0.0, 0.2, (T, H)), f32), jnp.asarray(rng.normal(size=(T, H, P)), f32),
                jnp.asarray(rng.normal(size=(T, H, N)), f32), jnp.asarray(rng.normal(size=(T, H, N)), f32))
    return (*rule, jnp.asarray(seq, jnp.int32), jnp.asarray(seq + 1, jnp.int32), jnp.full(T, fresh),
            jnp.asarray(np.append(seq[1:] != seq[:-1], True)),
            jnp.asarray(rng.normal(size=(len(lens) + 1, H, P, N)) * 0.1, f32))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rule", choices=["mamba", "delta"], default="mamba")
    parser.add_argument("--heads", type=int)
    parser.add_argument("--head-dim", type=int)
    parser.add_argument("--state", type=int, default=128)
    parser.add_argument("--chunks", default="16,32,64")
    parser.add_argument("--budget-s", type=float, default=60)
    a = parser.parse_args()
    budget = time.time() + a.budget_s
    delta = a.rule == "delta"
    H, P, N = a.heads or (32 if delta else 48), a.head_dim or (128 if delta else 64), a.state
    print(f"{'gated delta rule' if delta else 'selective scan'}, {H} heads x {P} channels x state {N}, {T} tokens; "
          f"{jax.devices()[0].device_kind}")
    token, chunked = (token_delta_scan, chunked_delta_scan) if delta else (token_scan, chunked_scan)
    fns = [("token", jax.jit(token))] + [
        (f"chunk{q}", jax.jit(functools.partial(chunked, chunk=int(q)))) for q in a.chunks.split(",")]
    for label, lens, fresh in (("one 512-token prompt", [T], True),
                               ("3 x 160 prompt tokens + 32 decodes", [160] * 3 + [1] * 32, False)):
        sets = [batch(lens, fresh, H, P, N, seed, delta) for seed in range(3)]
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
