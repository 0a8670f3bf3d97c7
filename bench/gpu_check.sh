#!/usr/bin/env bash
# The GPU check of the L7 kernels, for a machine with one NVIDIA GPU and no network (JAX with its CUDA
# plugin and pytest already installed): the kernel tests compiled for the GPU (not interpreted), for the
# Triton and the Mosaic GPU lowerings, then the kernel timings of both. Runs from the repository root without
# installing the package. Under 8 minutes (150 + 120 + 160 + 50 s at most).
# Output also goes to $OUT/gpu_check.log (or bench/results/) so it survives the session.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_common.sh
LOG="$LOG_DIR/gpu_check.log"

{
  print_environment

  echo "== kernel tests, compiled for the GPU (generic Pallas kernels, Triton lowering)"
  # float32 references at full precision: the default lets XLA use TF32, far outside the tests' tolerance.
  JAX_DEFAULT_MATMUL_PRECISION=highest timeout 150 "$PY" -m pytest -q -x --no-header -p no:cacheprovider \
    tests/test_kernels_attention.py tests/test_kernels_kv_write.py tests/test_kernels_latent.py \
    tests/test_kernels_sparse.py tests/test_kernels_sparse_index.py \
    tests/test_kv_cache_dtype.py tests/test_kernels_grouped_matmul.py tests/test_mamba_scan.py \
    -k "not real_model and not fp8_engine and not whole_pool"
  echo "tests exit code: $? ($(( $(date +%s) - start )) s)"

  # Separately, so that a failure of one lowering does not hide the other's results.
  echo "== Mosaic GPU kernel tests (decode and ragged), compiled for the GPU"
  JAX_DEFAULT_MATMUL_PRECISION=highest timeout 120 "$PY" -m pytest -q --no-header -p no:cacheprovider \
    tests/test_engine_pallas_mosaic.py tests/test_kernels_mosaic_ragged.py tests/test_kernels_mosaic_ws.py
  echo "mosaic tests exit code: $? ($(( $(date +%s) - start )) s)"

  echo "== kernel timings"
  timeout 160 "$PY" bench/gpu_kernels.py --budget-s 115
  echo "bench exit code: $? ($(( $(date +%s) - start )) s)"

  echo "== latent attention timings (DeepSeek's 576-wide entries)"
  timeout 50 "$PY" bench/gpu_latent.py --budget-s 25
  echo "latent bench exit code: $? ($(( $(date +%s) - start )) s total)"
} 2>&1 | tee "$LOG"
