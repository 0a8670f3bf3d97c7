#!/usr/bin/env bash
# The engine on one NVIDIA GPU, the step after bench/gpu_check.sh (kernels alone): the engine on the compiled
# Pallas kernels against its own XLA path (greedy tokens, float32 through the Triton lowering, bfloat16 through
# both lowerings), then `jaxserve bench offline` with random weights of SmolLM2's shapes in bfloat16
# (`--load-format dummy`), once per attention backend: batch 1 against the HBM floor, and 64 concurrent requests.
#
# The model's config and tokenizer come from a directory made on a machine with the bundled GGUF and carried:
#   jaxserve convert --to-hf bench/results/smollm2-config --config-only     (3.4 MB, no weights)
# Runs from the repository root without installing the package (JAX with its CUDA plugin, pytest, tokenizers
# and jinja2 already there; no network). Under 6 minutes (130 + 2 x 100 s at most).
# Settings (environment): MODEL (that directory), BACKENDS (default "pallas pallas_mosaic"), CONCURRENCY
# (default 64), MAX_NUM_SEQS (64), MAX_TOKENS (step token budget, 1024), INPUT_LEN (512), OUTPUT_LEN (128),
# QUANTIZATIONS (default none; e.g. "fp8 int8": one more run each, weights quantized at load, backend pallas,
# 100 s each).
# A dry run of the script on the CPU: BACKENDS=xla CONCURRENCY=4 MAX_NUM_SEQS=4 MAX_TOKENS=64 INPUT_LEN=32.
# Output also goes to $OUT/gpu_engine.log (or bench/results/), with each run's JSON beside it.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_common.sh
MODEL=${MODEL:-bench/results/smollm2-config}
BACKENDS=${BACKENDS:-pallas pallas_mosaic}
CONCURRENCY=${CONCURRENCY:-64}
LOG="$LOG_DIR/gpu_engine.log"

{
  print_environment

  echo "== the engine on the compiled kernels against its XLA path (also with drafts verified as chunks, and with a draft model), float8 Mosaic against the generic kernel (greedy tokens)"
  # float32 references at full precision: the default lets XLA use TF32 for them.
  JAX_DEFAULT_MATMUL_PRECISION=highest timeout 130 "$PY" -m pytest -q --no-header -p no:cacheprovider \
    tests/test_engine_pallas.py -k "matches_xla or fp8_cache"
  echo "engine tests exit code: $? ($(( $(date +%s) - start )) s)"

  if [ ! -f "$MODEL/config.json" ]; then
    echo "no $MODEL/config.json: make it with 'jaxserve convert --to-hf $MODEL --config-only' and carry it"
  else
    for backend in $BACKENDS; do
      echo "== offline throughput, random weights of $(basename "$MODEL")'s shapes, bfloat16, backend $backend"
      # shellcheck disable=SC2086
      timeout 100 "$PY" -m jaxserve.cli bench offline "$MODEL" --load-format dummy --dtype bfloat16 \
        --attention-backend "$backend" --workload random --random-input-len "${INPUT_LEN:-512}" \
        --output-len "${OUTPUT_LEN:-128}" --concurrency $CONCURRENCY --max-num-seqs "${MAX_NUM_SEQS:-64}" \
        --max-num-batched-tokens "${MAX_TOKENS:-1024}" --compile-cache-dir '' --quiet \
        --result-file "$LOG_DIR/gpu_engine_$backend.json"
      echo "bench exit code ($backend): $? ($(( $(date +%s) - start )) s total)"
    done
    for method in ${QUANTIZATIONS:-}; do
      echo "== offline throughput, as above with backend pallas, weights quantized at load: $method"
      # shellcheck disable=SC2086
      timeout 100 "$PY" -m jaxserve.cli bench offline "$MODEL" --load-format dummy --dtype bfloat16 \
        --quantization "$method" --attention-backend pallas --workload random \
        --random-input-len "${INPUT_LEN:-512}" --output-len "${OUTPUT_LEN:-128}" --concurrency $CONCURRENCY \
        --max-num-seqs "${MAX_NUM_SEQS:-64}" --max-num-batched-tokens "${MAX_TOKENS:-1024}" --compile-cache-dir '' \
        --quiet --result-file "$LOG_DIR/gpu_engine_pallas_$method.json"
      echo "bench exit code ($method): $? ($(( $(date +%s) - start )) s total)"
    done
  fi
} 2>&1 | tee "$LOG"
