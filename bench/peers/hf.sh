#!/usr/bin/env bash
# The plain HF transformers baseline (bench/peers/hf_server.py) as a peer, on 127.0.0.1.
#
#   bench/peers/hf.sh start [PORT]   # start in the background, wait until ready, print the PID
#   bench/peers/hf.sh stop PID
#
# It runs in jaxserve's own venv (torch and transformers are there already). Settings: PEER_DTYPE
# (float32 default, or bfloat16), CORES (taskset; the torch thread count follows it), HF_MAX_BATCH (32).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/common.sh"

start() {
  local port="${1:-8002}"
  export_hf_dir
  local threads
  threads="$($(cpu_prefix) nproc)"
  local logf="$BENCH_ROOT/bench/results/hf-$port.log"
  mkdir -p "$(dirname "$logf")"
  log "starting the HF baseline on 127.0.0.1:$port ($threads threads, $PEER_DTYPE), log $logf"
  $(cpu_prefix) "$JAXSERVE_PY" "$HERE/hf_server.py" --model "$HF_DIR" --port "$port" --served-model-name smollm2 \
    --dtype "$PEER_DTYPE" --threads "$threads" --max-batch-size "${HF_MAX_BATCH:-32}" >"$logf" 2>&1 &
  started $! "http://127.0.0.1:$port/health" "${START_TIMEOUT:-300}"
}

case "${1:-}" in
  start) shift; start "$@" ;;
  stop) stop_pid "${2:?PID}" ;;
  *) sed -n '2,9p' "$0"; exit 2 ;;
esac
