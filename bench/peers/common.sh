# Helpers shared by the peer scripts and bench/compare.sh (sourced, not run).
# Every server binds 127.0.0.1; nothing here reaches another machine except the package installs.

BENCH_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
JAXSERVE_PY="${JAXSERVE_PY:-$BENCH_ROOT/.venv/bin/python}"
# The HF directory the peers load: the bundled GGUF exported by our loader (`jaxserve convert`).
HF_DIR="${HF_DIR:-$BENCH_ROOT/bench/results/hf-smollm2}"
PEER_DTYPE="${PEER_DTYPE:-float32}"

log() { echo "[$(date +%H:%M:%S)] $*" >&2; }

# export_hf_dir: write $HF_DIR from the bundled GGUF once (float32: peers cast to their own dtype).
export_hf_dir() {
  if [[ -f "$HF_DIR/config.json" ]]; then return 0; fi
  log "exporting the bundled model to $HF_DIR"
  (cd "$BENCH_ROOT" && "$JAXSERVE_PY" -m jaxserve.cli convert --to-hf "$HF_DIR" --dtype float32)
}

# wait_http URL TIMEOUT_S [PID]: poll URL until it answers 200; fails early if PID exits.
wait_http() {
  local url="$1" timeout="$2" pid="${3:-}" t=0
  while (( t < timeout )); do
    if curl -sf -o /dev/null --noproxy '*' "$url"; then return 0; fi
    if [[ -n "$pid" ]] && ! kill -0 "$pid" 2>/dev/null; then log "server (pid $pid) exited"; return 1; fi
    sleep 2; t=$((t + 2))
  done
  log "timed out after ${timeout}s waiting for $url"; return 1
}

# started PID URL TIMEOUT_S: wait for a server just started in the background to answer URL, then print
# its PID; stop it and exit 1 if it does not.
started() {
  local pid="$1"
  wait_http "$2" "$3" "$pid" || { stop_pid "$pid"; exit 1; }
  echo "$pid"
}

# stop_pid PID: SIGTERM, then SIGKILL after 20 s; only the process we started.
stop_pid() {
  local pid="$1" t=0
  [[ -z "$pid" ]] && return 0
  kill -TERM "$pid" 2>/dev/null || return 0
  while kill -0 "$pid" 2>/dev/null && (( t < 20 )); do sleep 1; t=$((t + 1)); done
  kill -KILL "$pid" 2>/dev/null || true
}

# cpu_prefix: `taskset -c $CORES` when CORES is set, so every side runs on the same cores.
cpu_prefix() {
  if [[ -n "${CORES:-}" ]]; then echo "taskset -c $CORES"; fi
}
