"""Timings of a MoE layer's expert matmuls on the GPU: the Pallas grouped matmul against XLA's ragged dot, at a
Qwen3-30B-A3B layer's shapes (128 experts, 2048 wide, 768 per expert; gate/up and down), decode (64 tokens x 8
experts = 512 rows) and prefill (512 tokens: 4096 rows), bfloat16; several input sets of random routing. Each row:
the outputs' largest difference, then per implementation the median time per call, the weight bytes read per second
against the copy bandwidth measured in the same run, and FLOP/s. Usage: python bench/gpu_grouped_matmul.py [--budget-s S]"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.gpu_kernels import copy_bandwidth, run_row
from pallas_kernels.grouped_matmul import grouped_matmul

G, E, FE = 128, 2048, 768


def sets(rows: int, k: int, n: int, count: int = 3):
    rng = np.random.default_rng(rows + k)
    w = jnp.asarray(rng.normal(size=(G, k, n)) * 0.02, jnp.bfloat16)
    out = []
    for _ in range(count):
        sizes = np.bincount(rng.integers(0, G, rows), minlength=G).astype(np.int32)
        out.append((jnp.asarray(rng.normal(size=(rows, k)), jnp.bfloat16), w, jnp.asarray(sizes)))
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget-s", type=float, default=60)
    budget = time.time() + parser.parse_args().budget_s
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s; {jax.devices()[0].device_kind}")
    pallas = jax.jit(grouped_matmul)
    ragged = jax.jit(lambda x, w, g: jax.lax.ragged_dot(x, w, g))
    for label, rows in (("decode", 512), ("prefill", 4096)):
        for proj, k, n in (("gate/up", E, FE), ("down", FE, E)):
            if time.time() > budget:
                print("budget spent: rows left out")
                return 0
            args = sets(rows, k, n)
            try:  # (a failing kernel must not hide XLA's timings: run_row reports it)
                got, want = (f(*args[0]).astype(jnp.float32) for f in (pallas, ragged))
                diff = f"{float(jnp.max(jnp.abs(got - want))):.3g}"
            except Exception as e:
                diff = f"n/a: {type(e).__name__}"
            run_row(f"{label} {proj} rows={rows} (max |diff| {diff})", [("pallas", pallas), ("ragged_dot", ragged)],
                    args, args[0][1].nbytes, 2 * rows * k * n, None, copy_bw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
