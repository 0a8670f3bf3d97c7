# Shared by bench/gpu_check.sh and bench/gpu_engine.sh (sourced from the repository root): the Python to
# run (PYTHON, default python3), where the log goes ($OUT, else bench/results/), the repository on the
# import path (nothing is installed on the device machine), and the run's start time.
PY=${PYTHON:-python3}
LOG_DIR=${OUT:-bench/results}
mkdir -p "$LOG_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)

print_environment() {
  echo "== environment"
  "$PY" -c 'import sys, jax; print(sys.version.split()[0], "jax", jax.__version__, jax.devices())'
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
}
