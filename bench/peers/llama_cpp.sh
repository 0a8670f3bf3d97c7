#!/usr/bin/env bash
# Optional peer: llama.cpp through llama-cpp-python's OpenAI-compatible server, on the GGUF itself.
#
#   bench/peers/llama_cpp.sh install         # once: .venv-llamacpp; compiles llama.cpp (~15 minutes here)
#   bench/peers/llama_cpp.sh start [PORT]    # prints the PID once ready
#   bench/peers/llama_cpp.sh stop PID
#
# It reads the bundled Q4_1 GGUF directly (4-bit weights: less memory traffic per token than the
# float32 the others run, so it is not a same-dtype comparison; the report says so). Settings:
# CORES, LLAMA_CTX (context window, default 16384). It serves one request at a time.
# Its server does not take `ignore_eos`/`min_tokens`; output lengths can come out shorter, which the
# per-request output_len in the JSON shows.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/common.sh"
LLAMA_VENV="${LLAMA_VENV:-$BENCH_ROOT/.venv-llamacpp}"

install() {
  [[ -x "$LLAMA_VENV/bin/python" ]] || python3 -m venv "$LLAMA_VENV"
  CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" "$LLAMA_VENV/bin/pip" install "llama-cpp-python[server]"
}

start() {
  local port="${1:-8003}"
  local gguf
  gguf="$(cd "$BENCH_ROOT" && "$JAXSERVE_PY" -c 'from jaxserve.loader import bundled_model_path; print(bundled_model_path())')"
  local threads
  threads="$($(cpu_prefix) nproc)"
  local logf="$BENCH_ROOT/bench/results/llamacpp-$port.log"
  mkdir -p "$(dirname "$logf")"
  $(cpu_prefix) "$LLAMA_VENV/bin/python" -m llama_cpp.server --model "$gguf" --host 127.0.0.1 --port "$port" \
    --model_alias smollm2 --n_threads "$threads" --n_ctx "${LLAMA_CTX:-16384}" >"$logf" 2>&1 &
  started $! "http://127.0.0.1:$port/v1/models" "${START_TIMEOUT:-300}"
}

case "${1:-}" in
  install) install ;;
  start) shift; start "$@" ;;
  stop) stop_pid "${2:?PID}" ;;
  *) sed -n '2,13p' "$0"; exit 2 ;;
esac
