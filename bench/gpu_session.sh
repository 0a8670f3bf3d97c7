#!/usr/bin/env bash
# bench/gpu_check.sh and bench/gpu_engine.sh in one call on one NVIDIA GPU, under a deadline (DEADLINE_S,
# default 570 s): first the three test files' runs side by side (the Mosaic GPU kernel tests, the kernel tests
# through the Triton lowering, the engine against its XLA path), each in its own process with the GPU's memory
# taken as needed rather than preallocated; then the timings, alone on the GPU: the kernels (ROWS: the groups
# of bench/gpu_kernels.py's rows, in order), latent attention, the MoE grouped matmul, a hybrid model's selective
# scan, the engine's offline throughput per backend, then a hybrid model's (bench/hybrid_config.py)
# (BACKENDS, default "pallas_mosaic pallas": Hopper's default first). Each step's limit is its own or what is left
# before the deadline, whichever is less; a step with under 20 s left is skipped, said so in the log.
# Settings as bench/gpu_engine.sh's (BACKENDS, CONCURRENCY, MAX_NUM_SEQS, MAX_TOKENS, INPUT_LEN, OUTPUT_LEN).
# Carry bench/wheels (bench/gpu_wheels.sh) and bench/results/smollm2-config (see bench/gpu_engine.sh).
# Logs: $OUT/session.log (timings and the summary), $OUT/tests_{kernels,mosaic,engine}.log, and each offline
# run's JSON.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_common.sh
MODEL=${MODEL:-bench/results/smollm2-config}
DEADLINE_S=${DEADLINE_S:-570}
LOG="$LOG_DIR/session.log"

left() { echo $(( DEADLINE_S - ($(date +%s) - start) )); }

# limit LIMIT: the smaller of LIMIT and the time left, or nothing (and a line in the log) under 20 s.
limit() {
  local l
  l=$(left)
  if (( l < 20 )); then echo "skipped: $(( l < 0 ? 0 : l )) s left before the deadline" >&2; return 1; fi
  echo $(( $1 < l ? $1 : l ))
}

stamp() { echo "[$(( $(date +%s) - start )) s] $*"; }

{
  print_environment

  stamp "== tests, compiled for the GPU, three processes side by side"
  if t=$(limit 170); then
    pytest=(timeout "$t" "$PY" -m pytest -v --no-header -p no:cacheprovider --durations=10 -rfE)
    # A test that hangs (a kernel waiting on a barrier) ends its process with its stacks in the log, when
    # pytest-timeout is there (the machine's image has it).
    "$PY" -c "import pytest_timeout" 2>/dev/null && pytest+=(--timeout 90 --timeout-method thread)
    (
      export XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_DEFAULT_MATMUL_PRECISION=highest
      "${pytest[@]}" tests/test_kernels_mosaic_ragged.py tests/test_kernels_mosaic_ws.py \
        tests/test_engine_pallas_mosaic.py > "$LOG_DIR/tests_mosaic.log" 2>&1 &
      "${pytest[@]}" tests/test_kernels_attention.py tests/test_kernels_kv_write.py tests/test_kernels_latent.py \
        tests/test_kernels_sparse.py tests/test_kernels_sparse_index.py \
        tests/test_kv_cache_dtype.py tests/test_kernels_grouped_matmul.py tests/test_mamba_scan.py \
        -k "not real_model and not fp8_engine and not whole_pool" \
        > "$LOG_DIR/tests_kernels.log" 2>&1 &
      "${pytest[@]}" tests/test_engine_pallas.py -k "matches_xla or fp8_cache" > "$LOG_DIR/tests_engine.log" 2>&1 &
      wait
    )
    for name in mosaic kernels engine; do
      echo "-- tests_$name: $(grep -E '(passed|failed|error)' "$LOG_DIR/tests_$name.log" | tail -1)"
      grep -E '^(FAILED|ERROR) |(PASSED|FAILED|ERROR) +\[' "$LOG_DIR/tests_$name.log" | grep -v PASSED | head -20
      grep -E '::.* $' "$LOG_DIR/tests_$name.log" | tail -1 | sed 's/^/   unfinished: /'
    done
  fi

  stamp "== kernel timings"
  if t=$(limit 160); then
    timeout "$t" "$PY" bench/gpu_kernels.py --budget-s $(( t - 45 )) ${ROWS:+--rows "$ROWS"}
    echo "exit $?"
  fi

  stamp "== latent attention timings (DeepSeek's 576-wide entries)"
  if t=$(limit 45); then timeout "$t" "$PY" bench/gpu_latent.py --budget-s $(( t - 22 )); echo "exit $?"; fi

  stamp "== MoE grouped matmul timings (Qwen3-30B-A3B's experts: Pallas against XLA's ragged dot)"
  if t=$(limit 45); then timeout "$t" "$PY" bench/gpu_grouped_matmul.py --budget-s $(( t - 20 )); echo "exit $?"; fi

  stamp "== hybrid models' selective scan (Granite-4.0-H-Tiny's heads: chunked against one token a step)"
  if t=$(limit 40); then timeout "$t" "$PY" bench/hybrid_scan.py --budget-s $(( t - 20 )); echo "exit $?"; fi

  stamp "== Gated DeltaNet's delta rule (Qwen3-Next's heads: chunked against one token a step)"
  if t=$(limit 40); then timeout "$t" "$PY" bench/hybrid_scan.py --rule delta --budget-s $(( t - 20 )); echo "exit $?"; fi

  # BACKENDS: attention backends, each optionally with its layer loop after a colon ("pallas_mosaic:unroll"): the
  # scanned step's sm_90 program copies each layer's weights out of the stacked arrays (loop_dynamic_slice_fusion),
  # which the unrolled one does not.
  for entry in ${BACKENDS:-pallas_mosaic pallas}; do
    backend=${entry%%:*} loop=auto
    [[ $entry == *:* ]] && loop=${entry#*:}
    stamp "== offline throughput, random weights of SmolLM2's shapes, bfloat16, backend $backend, layer loop $loop"
    # Progress bars kept (on stderr, in the log): a warmup cut by the limit shows how far it came.
    if t=$(limit 150); then
      timeout "$t" "$PY" -m jaxserve.cli bench offline "$MODEL" --load-format dummy --dtype bfloat16 \
        --attention-backend "$backend" --workload random --random-input-len "${INPUT_LEN:-512}" \
        --output-len "${OUTPUT_LEN:-128}" --concurrency "${CONCURRENCY:-64}" --max-num-seqs "${MAX_NUM_SEQS:-64}" \
        --max-num-batched-tokens "${MAX_TOKENS:-1024}" --compile-cache-dir '' --layer-loop "$loop" \
        --result-file "$LOG_DIR/gpu_engine_${backend}_$loop.json"
      echo "exit $?"
    fi
  done
  stamp "== offline throughput, a hybrid model: random weights of Granite-4.0-H-Tiny's Mamba and attention shapes (12 layers, 3 attending, dense), bfloat16, backend pallas"
  if t=$(limit 150); then
    "$PY" bench/hybrid_config.py "$MODEL" "$LOG_DIR/granite-h-config" --layers 12 &&
      timeout "$t" "$PY" -m jaxserve.cli bench offline "$LOG_DIR/granite-h-config" --load-format dummy --dtype bfloat16 \
        --attention-backend pallas --workload random --random-input-len "${INPUT_LEN:-512}" \
        --output-len "${OUTPUT_LEN:-128}" --concurrency "${CONCURRENCY:-64}" --max-num-seqs "${MAX_NUM_SEQS:-64}" \
        --max-num-batched-tokens "${MAX_TOKENS:-1024}" --compile-cache-dir '' --result-file "$LOG_DIR/gpu_engine_hybrid.json"
    echo "exit $?"
  fi
  stamp "done"
} 2>&1 | tee "$LOG"
