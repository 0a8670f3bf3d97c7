# Shared by bench/gpu_check.sh and bench/gpu_engine.sh (sourced from the repository root): the Python to
# run (PYTHON, default python3), where the log goes ($OUT, else bench/results/), the repository and any
# carried wheels on the import path (nothing is installed on the device machine), and the run's start time.
PY=${PYTHON:-python3}
LOG_DIR=${OUT:-bench/results}
mkdir -p "$LOG_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)

# Wheels carried in bench/wheels/ (fetched by bench/gpu_wheels.sh; the machine has no network) go to a
# scratch site-packages on the import path.
if compgen -G "bench/wheels/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/jaxserve-site \
    bench/wheels/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/jaxserve-site"
fi

print_environment() {
  echo "== environment"
  "$PY" -c 'import sys, jax; print(sys.version.split()[0], "jax", jax.__version__, jax.devices())'
  "$PY" - <<'PY'
from importlib import metadata
versions = {}
for name in ("jax-cuda12-plugin", "jax-cuda13-plugin", "triton", "jax-triton"):
    try:
        versions[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        pass
from pallas_kernels import triton_available
print(versions, "jax_triton usable:", triton_available())
PY
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
}
