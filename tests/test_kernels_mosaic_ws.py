"""The warp-specialized ragged Mosaic GPU kernel (two compute warpgroups sharing each K/V stage, one loading
warpgroup) in Mosaic GPU's CPU interpreter against the float64 oracle, and its refusals.

The interpreter runs the three warpgroups as threads and simulates SMEM, the TMA page copies and every barrier
(the stage ring, the releases, the turn-taking), and it raises when a barrier phase is skipped or left
unobserved. The cases run in a child process with 8 simulated devices (tests/mosaic_ws_worker.py says why),
under a time limit, so a deadlock fails instead of hanging. The WGMMA path is compiled for sm_90 in
tests/gpu_compile; on a GPU (bench/gpu_check.sh) the compiled kernel runs these cases and a larger one in
this process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_attention_args import quantize_kv
from pallas_kernels.ragged_attention_mosaic import ragged_paged_attention_mosaic, ws_block_kv, ws_smem_bytes
from tests.mosaic_ws_worker import CASES, GPU_CASES, run_cases
from tests.test_kernels_cases import make_batch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 3e-2  # bfloat16 queries and probabilities
GPU = jax.default_backend() == "gpu"


def test_warp_specialized_kernel_matches_oracle():
    if GPU:  # compiled: no interpreter threads, so in this process, with a larger case too
        results = list(run_cases(CASES + GPU_CASES))
    else:
        # The interpreter compiles each warpgroup's program again in every case (programs with host callbacks
        # are never cached) and runs them mostly in callbacks: XLA's quickest compile takes a quarter off (52 s to 40 s).
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8 "
                   "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
        proc = subprocess.run([sys.executable, "-m", "tests.mosaic_ws_worker"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["case"] for r in results] == [c[0] for c in CASES + (GPU_CASES if GPU else [])]
    for r in results:
        assert r["shape_ok"] and r["dtype"] == "float32", r
        assert r["finite"], f"non-finite output: a scratch-page row reached the products: {r}"
        assert r["max_err"] < TOL * max(1.0, r["max_ref"]), r
        assert r["padding_zero"], r


def test_default_block_kv_and_shared_memory():
    assert ws_block_kv(2, 128, 16) == 128  # 2 x 64 x 128 q tiles + 2 stages x (K + V) x 128 x 128: 160 KiB
    assert ws_smem_bytes(2, 128, 128) == 2 * 64 * 128 * 2 + 2 * 2 * 128 * 128 * 2 + 1024
    # Float8 pages add their landing ring: 225 KiB at 128-key blocks of 128-wide heads, which still fit.
    assert ws_smem_bytes(2, 128, 128, 1) == ws_smem_bytes(2, 128, 128) + 2 * 2 * 128 * 128
    assert ws_block_kv(2, 128, 16, 1) == 128
    assert ws_block_kv(2, 256, 16, 1) is None  # 64 keys of 256-wide heads: 256 KiB
    assert ws_block_kv(2, 256, 16) == 64  # 128 keys of 256-wide heads would need 320 KiB
    assert ws_block_kv(2, 64, 256) == 256  # the block must hold whole pages


def test_warp_specialized_refusals():
    rng = np.random.default_rng(0)
    batch = make_batch(rng, page_size=16, head_dim=64, group=4, num_kv_heads=1, dtype=jnp.bfloat16,
                       seqs=[(3, 20)], pages_per_seq=2)
    args = (batch.q, batch.k_pages, batch.v_pages, batch.block_tables, batch.seq_lens, batch.query_start_loc)
    with pytest.raises(ValueError, match="compute_wgs must be 1 or 2"):
        ragged_paged_attention_mosaic(*args, sm_scale=0.125, compute_wgs=3, interpret=True)
    big = make_batch(rng, page_size=16, head_dim=256, group=4, num_kv_heads=1, dtype=jnp.bfloat16,
                     seqs=[(3, 20)], pages_per_seq=2)
    big_args = (big.q, big.k_pages, big.v_pages, big.block_tables, big.seq_lens, big.query_start_loc)
    with pytest.raises(ValueError, match="block_kv 128 x head_dim 256 in 2 stages needs 328704 bytes of shared memory"):
        ragged_paged_attention_mosaic(*big_args, sm_scale=0.125, block_kv=128, compute_wgs=2, interpret=True)
    # With float8 pages the landing ring does not fit beside 64-key blocks of 256-wide heads: their chunks take
    # the one-warpgroup form.
    fp8 = dataclasses.replace(big, k_pages=quantize_kv(big.k_pages, jnp.float8_e4m3fn),
                              v_pages=quantize_kv(big.v_pages, jnp.float8_e4m3fn))
    with pytest.raises(ValueError, match="needs 263168 bytes of shared memory"):
        ragged_paged_attention_mosaic(fp8.q, fp8.k_pages, fp8.v_pages, *big_args[3:], sm_scale=0.125, compute_wgs=2,
                                      interpret=True)


def test_warpgroup_registers_fit_the_programs_pool():
    """`setmaxnreg` moves registers between a program's warpgroups within what it was launched with (168 a thread
    for 384 threads): counts past that pool hang the compute warpgroups' increase on a GPU, and the interpreter
    cannot see it. (tests/gpu_compile checks the pool and the spills against ptxas.)"""
    from pallas_kernels import ragged_mosaic_ws as ws

    threads = (ws.COMPUTE_WGS + 1) * 128
    assert ws.REGISTER_POOL == (ws.COMPUTE_WGS + 1) * (65536 // threads // 8 * 8)
    for fp8 in (False, True):
        loader, compute = ws.LOADER_REGISTERS[fp8], ws.COMPUTE_REGISTERS[fp8]
        assert loader % 8 == 0 and compute % 8 == 0 and 24 <= loader <= compute <= 256
        assert loader + ws.COMPUTE_WGS * compute <= ws.REGISTER_POOL, (fp8, loader, compute)
