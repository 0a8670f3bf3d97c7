#!/usr/bin/env bash
# Deviceless sm_90 compile check of the Pallas kernels.
#
# Creates .venv-cuda (git-ignored) with jax[cuda12] at the main venv's jax version plus jax-triton, then
# compiles every kernel for an H200 through a deviceless topology. No GPU is needed; the CUDA plugin only
# provides the compiler. Usage: .ci/gpu_compile.sh [extra pytest args]
#
# The same check for another JAX release (the GPU machine's image has JAX 0.11 with CUDA 13 on Python 3.12;
# JAX 0.11 needs Python 3.12 or newer): GPU_COMPILE_PYTHON=<python3.12+> GPU_COMPILE_JAX=0.11.2
# GPU_COMPILE_CUDA=13 GPU_COMPILE_VENV=.venv-cuda13 GPU_COMPILE_EXTRA='jax-triton==0.3.1 triton==3.6.0'
# .ci/gpu_compile.sh, the last pinning that image's Triton (bench/README.md says how to get such a Python).
# GPU_COMPILE_STAGE=install stops once the venv is ready; =compile skips the install (`.ci/run` installs while the
# suite runs, then compiles).
set -euo pipefail
cd "$(dirname "$0")/.."

MAIN_PY=.venv/bin/python
VENV=${GPU_COMPILE_VENV:-.venv-cuda}
CUDA=${GPU_COMPILE_CUDA:-12}
start=$(date +%s)

JAX_VERSION=${GPU_COMPILE_JAX:-$("$MAIN_PY" -c 'import jax; print(jax.__version__)')}
BASE_PY=${GPU_COMPILE_PYTHON:-$("$MAIN_PY" -c 'import sys; print(sys._base_executable)')}

STAGE=${GPU_COMPILE_STAGE:-all}
if [ "$STAGE" != compile ]; then
  if [ ! -x "$VENV/bin/python" ]; then
    "$BASE_PY" -m venv "$VENV"
  fi
  # jax[cudaNN] pinned to the main venv's version (or GPU_COMPILE_JAX) so the same kernels are compiled; jax-triton
  # is resolved against that pin in the same command so it cannot drag jax to another version.
  "$VENV/bin/pip" install -q --disable-pip-version-check \
    "jax[cuda${CUDA}]==${JAX_VERSION}" "jaxlib==${JAX_VERSION}" jax-triton pytest pytest-xdist ${GPU_COMPILE_EXTRA:-}
  "$VENV/bin/pip" install -q --disable-pip-version-check -e . --no-deps
fi

"$VENV/bin/python" - <<PY
import jax
assert jax.__version__ == "${JAX_VERSION}", (jax.__version__, "${JAX_VERSION}")
PY

if [ "$STAGE" != compile ]; then
  echo "gpu_compile: venv ready in $(( $(date +%s) - start )) s (jax ${JAX_VERSION})"
fi
[ "$STAGE" = install ] && exit 0

# The constraints check compares the CUDA runtime against a driver; there is no driver here. Two workers: each
# compile is one process's work (the tests share no state but a cheap topology).
JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 JAX_PLATFORMS=cpu \
  "$VENV/bin/python" -m pytest -q -m gpu_compile tests/gpu_compile -p no:cacheprovider -n 2 --durations=25 "$@"

echo "gpu_compile: total $(( $(date +%s) - start )) s"
