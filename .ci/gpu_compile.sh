#!/usr/bin/env bash
# Deviceless sm_90 compile check of the Pallas kernels.
#
# Creates .venv-cuda (git-ignored) with jax[cuda12] at the main venv's jax version plus jax-triton, then
# compiles every kernel for an H200 through a deviceless topology. No GPU is needed; the CUDA plugin only
# provides the compiler. Usage: .ci/gpu_compile.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."

MAIN_PY=.venv/bin/python
VENV=.venv-cuda
start=$(date +%s)

JAX_VERSION=$("$MAIN_PY" -c 'import jax; print(jax.__version__)')
BASE_PY=$("$MAIN_PY" -c 'import sys; print(sys._base_executable)')

if [ ! -x "$VENV/bin/python" ]; then
  "$BASE_PY" -m venv "$VENV"
fi
# jax[cuda12] pinned to the main venv's version so the same kernels are compiled; jax-triton is resolved
# against that pin in the same command so it cannot drag jax to another version.
"$VENV/bin/pip" install -q --disable-pip-version-check \
  "jax[cuda12]==${JAX_VERSION}" "jaxlib==${JAX_VERSION}" jax-triton pytest
"$VENV/bin/pip" install -q --disable-pip-version-check -e . --no-deps

"$VENV/bin/python" - <<PY
import jax
assert jax.__version__ == "${JAX_VERSION}", (jax.__version__, "${JAX_VERSION}")
PY

installed=$(date +%s)
echo "gpu_compile: venv ready in $((installed - start)) s (jax ${JAX_VERSION})"

# The constraints check compares the CUDA runtime against a driver; there is no driver here.
JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 JAX_PLATFORMS=cpu \
  "$VENV/bin/python" -m pytest -q -m gpu_compile tests/gpu_compile -p no:cacheprovider --durations=25 "$@"

echo "gpu_compile: total $(( $(date +%s) - start )) s"
