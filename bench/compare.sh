#!/usr/bin/env bash
# jaxserve side by side with its peers on this machine: the same workloads, the same client, the same
# cores, one server at a time, in alternating order, then one comparison table and the charts.
#
#   bench/compare.sh                        # jaxserve, vLLM CPU (if installed), HF transformers
#   SYSTEMS="jaxserve hf" ROUNDS=1 bench/compare.sh
#
# Settings (environment):
#   SYSTEMS      which sides, in the first round's order (default: jaxserve vllm hf; llamacpp optional);
#                a side whose install is missing is skipped with a note
#   ROUNDS       rounds over the sides (default 1; about 25 minutes with the defaults on 2 cores); every
#                other round runs them in reverse order, so neither side always runs first (warm caches,
#                thermal state, neighbours' load)
#   CORES        cores every server runs on (taskset), e.g. 0-1; the client runs beside them
#   PEER_DTYPE   float32 (default: jaxserve's CPU dtype) or bfloat16, for every side that takes it
#   VLLM_EAGER   1: vLLM without torch.compile (starts in ~1 minute instead of ~5; noted in settings.txt)
#   CONCURRENCY  fixed-workload concurrency sweep (default "1 8 32")
#   NUM_PROMPTS  fixed-workload requests per concurrency above 1 (default 32)
#   NUM_PROMPTS_C1  fixed-workload requests at concurrency 1 (default 8: one stream at a time is slow)
#   OUTPUT_LEN   forced output tokens (default 128)
#   GSP          shared-prefix "groups prompts_per_group system_len question_len" (default "4 8 512 64")
#   GSP_CONCURRENCY  shared-prefix concurrency (default 32)
#   OUT          result directory (default bench/results/compare-<time>)
#
# Output: OUT/<side>-<workload>-r<round>.json for each run, OUT/table.txt (ratios to jaxserve), OUT/plots/
# (with matplotlib), OUT/settings.txt (cores, threads and dtype of each side), OUT/timings.txt (seconds
# each side took to start and to run its benchmarks). Everything is on 127.0.0.1.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/peers/common.sh"

SYSTEMS="${SYSTEMS:-jaxserve vllm hf}"
ROUNDS="${ROUNDS:-1}"
CONCURRENCY="${CONCURRENCY:-1 8 32}"
NUM_PROMPTS="${NUM_PROMPTS:-32}"
NUM_PROMPTS_C1="${NUM_PROMPTS_C1:-8}"
OUTPUT_LEN="${OUTPUT_LEN:-128}"
read -r GSP_GROUPS GSP_PER GSP_SYS GSP_Q <<<"${GSP:-4 8 512 64}"
GSP_CONCURRENCY="${GSP_CONCURRENCY:-32}"
OUT="${OUT:-$BENCH_ROOT/bench/results/compare-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
export CORES PEER_DTYPE VLLM_EAGER

declare -A PORT=([jaxserve]=8100 [vllm]=8101 [hf]=8102 [llamacpp]=8103)
declare -A SCRIPT=([jaxserve]=jaxserve.sh [vllm]=vllm_cpu.sh [hf]=hf.sh [llamacpp]=llama_cpp.sh)

available() {
  case "$1" in
    vllm) [[ -x "${VLLM_VENV:-$BENCH_ROOT/.venv-vllm}/bin/vllm" ]] ;;
    llamacpp) [[ -x "${LLAMA_VENV:-$BENCH_ROOT/.venv-llamacpp}/bin/python" ]] ;;
    jaxserve|hf) true ;;
    *) log "unknown side $1"; return 1 ;;
  esac
}

serve_run() {  # side round file_tag flags...: one `jaxserve bench serve`, its JSON at OUT/<side>-<tag>-r<round>.json
  local side="$1" r="$2" tag="$3"; shift 3
  (cd "$BENCH_ROOT" && "$JAXSERVE_PY" -m jaxserve.cli bench serve --base-url "http://127.0.0.1:${PORT[$side]}" \
    --label "$side" --output-len "$OUTPUT_LEN" --result-file "$OUT/$side-$tag-r$r.json" "$@") | tee -a "$OUT/log.txt"
}

bench_serve() {  # side round
  local side="$1" r="$2" c rest=()
  for c in $CONCURRENCY; do
    if [[ "$c" == 1 ]]; then
      # One stream at a time is the slow part of the sweep: it gets its own, smaller, request count.
      serve_run "$side" "$r" fixed-c1 --workload fixed --num-prompts "$NUM_PROMPTS_C1" --max-concurrency 1 \
        --warmup-requests 2
    else
      rest+=("$c")
    fi
  done
  if (( ${#rest[@]} )); then
    serve_run "$side" "$r" fixed --workload fixed --num-prompts "$NUM_PROMPTS" --max-concurrency "${rest[@]}" \
      --warmup-requests 2
  fi
  serve_run "$side" "$r" shared-prefix --workload shared-prefix --gsp-num-groups "$GSP_GROUPS" \
    --gsp-prompts-per-group "$GSP_PER" --gsp-system-prompt-len "$GSP_SYS" --gsp-question-len "$GSP_Q" \
    --max-concurrency "$GSP_CONCURRENCY" --warmup-requests 0
}

PID=""
cleanup() { if [[ -n "${PID:-}" ]]; then stop_pid "$PID"; fi; }  # a plain && would make the exit status 1
trap cleanup EXIT

export_hf_dir
{
  echo "machine: $(nproc) cores usable ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-)), load $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "cores for every server: ${CORES:-all}; dtype: ${PEER_DTYPE}; output tokens forced to $OUTPUT_LEN (ignore_eos, min_tokens)"
  echo "jaxserve: XLA CPU, all threads of the cores it is given; num_scheduler_steps default"
  echo "vllm: VLLM_CPU_OMP_THREADS_BIND=${CORES:-0-$(( $(nproc) - 1 ))} VLLM_CPU_NUM_OF_RESERVED_CPU=0 (no core kept for its API server)$([[ "${VLLM_EAGER:-0}" == 1 ]] && echo "; --enforce-eager (VLLM_EAGER=1: no torch.compile)")"
  echo "hf: torch threads = cores given; static batches of up to ${HF_MAX_BATCH:-32} through model.generate"
  echo "client: one jaxserve bench serve process beside the server, on the same machine"
} | tee "$OUT/settings.txt"

order=($SYSTEMS)
for (( r = 1; r <= ROUNDS; r++ )); do
  sides=("${order[@]}")
  if (( r % 2 == 0 )); then
    sides=(); for (( i = ${#order[@]} - 1; i >= 0; i-- )); do sides+=("${order[$i]}"); done
  fi
  for side in "${sides[@]}"; do
    if ! available "$side"; then log "skipping $side (not installed; see bench/peers/)"; continue; fi
    log "round $r: $side"
    t0=$SECONDS
    PID="$("$HERE/peers/${SCRIPT[$side]}" start "${PORT[$side]}")" || { log "$side failed to start"; PID=""; continue; }
    t1=$SECONDS
    bench_serve "$side" "$r" || log "$side: the benchmark failed"
    stop_pid "$PID"; PID=""
    echo "round $r $side: start $((t1 - t0)) s, benchmark $((SECONDS - t1)) s" | tee -a "$OUT/timings.txt"
  done
done

shopt -s nullglob
for wl in fixed shared-prefix; do
  files=(); names=()
  for side in "${order[@]}"; do
    # fixed-c1 and fixed of one side and round share a column (bench compare merges equal names).
    for f in "$OUT/$side-$wl"-c1-r*.json "$OUT/$side-$wl"-r*.json; do
      files+=("$f"); names+=("$side-$(basename "$f" .json | sed 's/.*-r/r/')")
    done
  done
  (( ${#files[@]} )) || continue
  (cd "$BENCH_ROOT" && "$JAXSERVE_PY" -m jaxserve.cli bench compare "${files[@]}" --names "${names[@]}" \
    --plot "$OUT/plots") | tee -a "$OUT/table.txt"
done
log "results in $OUT (table.txt, settings.txt, plots/)"
