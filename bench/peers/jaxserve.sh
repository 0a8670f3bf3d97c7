#!/usr/bin/env bash
# jaxserve itself, started the same way as the peers, on 127.0.0.1.
#
#   bench/peers/jaxserve.sh start [PORT]   # start `jaxserve serve` in the background, wait for /ready, print the PID
#   bench/peers/jaxserve.sh stop PID
#
# Settings: CORES (taskset), PEER_DTYPE (float32 default; bfloat16), MAX_NUM_SEQS (256),
# JAXSERVE_ARGS (more `jaxserve serve` flags). The bundled GGUF is served (as the peers' HF export of it).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/common.sh"

start() {
  local port="${1:-8000}"
  local logf="$BENCH_ROOT/bench/results/jaxserve-$port.log"
  mkdir -p "$(dirname "$logf")"
  log "starting jaxserve on 127.0.0.1:$port ($PEER_DTYPE), log $logf"
  # shellcheck disable=SC2086
  (cd "$BENCH_ROOT" && exec $(cpu_prefix) "$JAXSERVE_PY" -m jaxserve.cli serve --host 127.0.0.1 --port "$port" \
    --served-model-name smollm2 --dtype "$PEER_DTYPE" --max-num-seqs "${MAX_NUM_SEQS:-256}" \
    --max-model-len "${MAX_MODEL_LEN:-4096}" ${JAXSERVE_ARGS:-}) >"$logf" 2>&1 &
  # Warmup compiles every shape bucket (minutes on 2 busy cores the first time, cached afterwards).
  started $! "http://127.0.0.1:$port/ready" "${START_TIMEOUT:-900}"
}

case "${1:-}" in
  start) shift; start "$@" ;;
  stop) stop_pid "${2:?PID}" ;;
  *) sed -n '2,8p' "$0"; exit 2 ;;
esac
