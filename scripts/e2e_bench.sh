#!/usr/bin/env bash
# End-to-end benchmarks on a GPU box, from the repo root after `pip install -e .`:
#     bash scripts/e2e_bench.sh
# Makes a random Llama-3.2-1B-shaped checkpoint (bf16), then runs, most important first: throughput
# (CUDA graphs), latency at batch 1, flexengine vs transformers, and throughput / latency with
# --enforce-eager. Each step runs under `timeout` and logs to $OUT/<step>.log; all steps share one
# time budget (a step that no longer fits is skipped, and says so); a summary comes last.
# Env knobs: OUT (bench_out), MODEL_DIR (/tmp/llama1b), PRESET (llama-3.2-1b), NUM_PROMPTS (256),
#   TF_PROMPTS (prompts for transformers generate_batch, default NUM_PROMPTS), BATCH1 (1: add the
#   batch-1 comparison with transformers generate, ~1-2 min more), BUDGET (seconds, 390), PYTHON,
#   DRY_RUN (1: print the commands, run nothing), STEPS (which of throughput latency
#   compare_transformers throughput_eager latency_eager compare_prompt_heavy compare_long to run, in that
#   order; default the first five), ENGINE_ARGS (extra engine flags for every run, e.g.
#   "--num-scheduler-steps 8"). The prompt-heavy comparisons (issue 15): compare_prompt_heavy is 64 prompts
#   x 2048 tokens x 16 out (vLLM's benchmark_throughput --input-len 2048 --output-len 16), throughput_sync and
#   latency_sync (throughput and latency with --no-async-scheduling, the default before session 15), compare_long
#   16 x 6144 x 256. long_context (issue 24): prefill of 8k, 16k, 32k and 64k prompts against transformers'
#   forward, at the engine's default max_model_len (the model's context) unless ENGINE_ARGS says otherwise.
set -u
OUT=${OUT:-bench_out}
MODEL_DIR=${MODEL_DIR:-/tmp/llama1b}
PRESET=${PRESET:-llama-3.2-1b}
NUM_PROMPTS=${NUM_PROMPTS:-256}
TF_PROMPTS=${TF_PROMPTS:-$NUM_PROMPTS}
BATCH1=${BATCH1:-0}
BUDGET=${BUDGET:-390}
PY=${PYTHON:-python3}
DRY_RUN=${DRY_RUN:-0}
STEPS=${STEPS:-throughput latency compare_transformers throughput_eager latency_eager}  # see the header for more
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
for s in make_model $STEPS; do rm -f "$OUT/$s.log" "$OUT/$s.json"; done  # no stale results
want() { [[ " $STEPS " == *" $1 "* ]]; }
START=$(date +%s)
STATUS=()

# run_step NAME LIMIT CMD...: run CMD under min(LIMIT, budget left), tee'd into $OUT/NAME.log.
# The limits hold a fresh box's first start (empty compile caches: ~160 s at the default max_model_len on the H100,
# session 36, whose `compare` was cut at the old 200 s after transformers' own 41 s).
run_step() {
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if (( left < 30 )); then
    STATUS+=("$name: SKIPPED (${left}s of the ${BUDGET}s budget left)"); echo "=== $name skipped: budget spent"; return 1
  fi
  (( limit > left )) && limit=$left
  echo "=== $name (timeout ${limit}s): $*"
  (( DRY_RUN )) && { STATUS+=("$name: dry run"); return 0; }
  local t0=$(date +%s)
  timeout --kill-after=15 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]} took=$(( $(date +%s) - t0 ))
  case $rc in
    0) STATUS+=("$name: ok (${took}s)") ;;
    124|137) STATUS+=("$name: TIMED OUT after ${limit}s") ;;
    *) STATUS+=("$name: FAILED rc=$rc (${took}s), see $OUT/$name.log") ;;
  esac
  return "$rc"
}

summary() {
  echo; echo "=================== e2e summary ($(( $(date +%s) - START ))s) ==================="
  printf '%s\n' "${STATUS[@]}"
  local log
  for log in "$OUT"/throughput*.log "$OUT"/latency*.log "$OUT"/compare_*.log "$OUT"/long_context.log; do
    [[ -f $log ]] || continue
    echo "--- $(basename "$log" .log)"
    grep -E '^(# |Throughput:|Cold start|Graphs compiled|Avg latency|Decode:|Weight-read|Achieved|\| |flexengine / transformers|transformers generate_batch)' "$log"
  done
}

COMMON=(--model "$MODEL_DIR" --dtype bfloat16 ${ENGINE_ARGS:-})
if [[ -f $MODEL_DIR/config.json ]]; then  # config.json is written last: its presence means a whole checkpoint
  STATUS+=("make-model: reused $MODEL_DIR")
else
  run_step make_model 180 "$PY" -m flexengine.cli make-model --preset "$PRESET" --out "$MODEL_DIR" --dtype bfloat16 \
    || { summary; exit 1; }
fi
want throughput && run_step throughput 300 "$PY" -m flexengine.cli bench throughput "${COMMON[@]}" --num-prompts "$NUM_PROMPTS" \
  --input-len 256 --output-len 256 --json-out "$OUT/throughput.json"
want latency && run_step latency 240 "$PY" -m flexengine.cli bench latency "${COMMON[@]}" --max-num-seqs 1 --batch-size 1 --input-len 128 \
  --output-len 256 --num-iters 3 --json-out "$OUT/latency.json"
B1=(); (( BATCH1 )) && B1=(--batch1)
want compare_transformers && run_step compare_transformers $(( BATCH1 ? 460 : 360 )) "$PY" -m flexengine.benchmarks.compare_transformers "${COMMON[@]}" \
  --num-prompts "$NUM_PROMPTS" --tf-num-prompts "$TF_PROMPTS" --input-len 256 --output-len 256 ${B1[@]+"${B1[@]}"} \
  --json-out "$OUT/compare_transformers.json"
# the same two runs without async scheduling (the default before session 15): what it is worth, in one call
want throughput_sync && run_step throughput_sync 150 "$PY" -m flexengine.cli bench throughput "${COMMON[@]}" \
  --no-async-scheduling --num-prompts "$NUM_PROMPTS" --input-len 256 --output-len 256 --json-out "$OUT/throughput_sync.json"
want latency_sync && run_step latency_sync 120 "$PY" -m flexengine.cli bench latency "${COMMON[@]}" --no-async-scheduling \
  --max-num-seqs 1 --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 --json-out "$OUT/latency_sync.json"
want throughput_eager && run_step throughput_eager 120 "$PY" -m flexengine.cli bench throughput "${COMMON[@]}" --enforce-eager \
  --num-prompts "$NUM_PROMPTS" --input-len 256 --output-len 256 --json-out "$OUT/throughput_eager.json"
want latency_eager && run_step latency_eager 100 "$PY" -m flexengine.cli bench latency "${COMMON[@]}" --max-num-seqs 1 --enforce-eager --batch-size 1 \
  --input-len 128 --output-len 256 --num-iters 2 --json-out "$OUT/latency_eager.json"
want compare_prompt_heavy && run_step compare_prompt_heavy 300 "$PY" -m flexengine.benchmarks.compare_transformers \
  "${COMMON[@]}" --num-prompts 64 --input-len 2048 --output-len 16 --json-out "$OUT/compare_prompt_heavy.json"
want compare_long && run_step compare_long 400 "$PY" -m flexengine.benchmarks.compare_transformers "${COMMON[@]}" \
  --num-prompts 16 --input-len 6144 --output-len 256 --json-out "$OUT/compare_long.json"
want long_context && run_step long_context 400 "$PY" -m flexengine.benchmarks.long_context "${COMMON[@]}" \
  --json-out "$OUT/long_context.json"
summary
