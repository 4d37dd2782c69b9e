#!/usr/bin/env bash
# Serving benchmark on a GPU box (issue 7): the llama-3.2-1b preset, 256 prompts of 256 in / 256 out,
# request rate inf and 16/s against `flexengine serve`, and the offline engine's throughput on the
# same workload in the same run. From the repo root after `pip install -e .`; logs in $OUT. ENGINE_ARGS
# go to both the server and the offline run; the default names the server's own GPU default
# (--async-scheduling), so that the offline engine runs the same way ("--no-async-scheduling" or
# "--num-scheduler-steps 8" for the others).
set -u
OUT=${OUT:-bench_out}; MODEL_DIR=${MODEL_DIR:-/tmp/llama1b}; PORT=${PORT:-8123}; PY=${PYTHON:-python3}
mkdir -p "$OUT"
WHEELS=${WHEELS:-.whl}  # the GPU box has no network: serve's wheels come from scripts/serve_wheels.sh
if compgen -G "$WHEELS/*.whl" >/dev/null && ! $PY -c "import fastapi, uvicorn" 2>/dev/null; then
  # Only the wheels newer than what the box has: /tmp/serve_site comes first on the path.
  mapfile -t newer < <($PY scripts/newer_wheels.py "$WHEELS"/*.whl)
  rm -rf /tmp/serve_site  # a warm box keeps the last call's
  (( ${#newer[@]} )) && $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/serve_site "${newer[@]}"
  export PYTHONPATH=/tmp/serve_site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/serve_site/bin:$PATH  # py-spy
fi
[[ -f $MODEL_DIR/config.json ]] || $PY -m flexengine.cli make-model --preset llama-3.2-1b --out "$MODEL_DIR" --dtype bfloat16
# A native crash in the engine process then prints every thread's Python stack into server.log.
PYTHONFAULTHANDLER=1 FLEXENGINE_STATS_INTERVAL_S=${STATS_INTERVAL_S:-1} $PY -m flexengine.cli serve "$MODEL_DIR" --dtype bfloat16 ${ENGINE_ARGS---async-scheduling} --port "$PORT" --max-waiting-requests 1024 \
  --uvicorn-log-level warning > "$OUT/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null' EXIT
for _ in $(seq 240); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  kill -0 $server 2>/dev/null || { echo "server exited:"; tail -n 20 "$OUT/server.log"; exit 1; }
  sleep 1
done
# The engine process is the server's spawned child that is not multiprocessing's resource tracker.
engine=$(ps -o pid= -o args= --ppid $server | grep -v resource_tracker | awk 'NR==1 {print $1}')
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0; }  # user + system, all threads
# Each thread of a process: "tid name ticks" (user + system; spaces in a name become _).
thread_ticks() { for f in /proc/$1/task/*/stat; do cat "$f" 2>/dev/null; echo; done | awk 'NF {
  i = index($0, "("); j = match($0, /\) [A-Za-z] /); name = substr($0, i + 1, j - i - 1); gsub(/ /, "_", name)
  split(substr($0, j + 2), x, " "); print $1, name, x[12] + x[13] }'; }
TICK=$(getconf CLK_TCK)
# RATES="inf 16 inf" runs rate inf twice (the second as serve_rate_inf_2.*). Each run draws other
# prompts (--seed): the prefix cache would otherwise hold the last run's and skip their prefill.
seed=0
for rate in ${RATES:-inf 16}; do
  name=$rate; [[ -f $OUT/serve_rate_$name.json ]] && name=${rate}_2
  seed=$((seed + 1))
  api0=$(cpu_ticks $server); eng0=$(cpu_ticks $engine); t0=$(date +%s.%N); thread_ticks $engine > "$OUT/threads0"
  spies=()
  if [[ -n ${PYSPY:-} && $rate == inf ]] && command -v py-spy >/dev/null; then
    # Sample both processes through the middle of the run (after the prompts' prefill), as folded stacks.
    for who in engine:$engine api:$server; do
      (sleep "${PYSPY_DELAY:-2}"; py-spy record --nonblocking ${PYSPY_ARGS:-} --format raw -r 500 -d "${PYSPY_SECONDS:-2}" \
        -o "$OUT/pyspy_${who%%:*}.txt" -p "${who##*:}" >"$OUT/pyspy_${who%%:*}.log" 2>&1) &
      spies+=($!)
    done
  fi
  $PY -m flexengine.cli bench serve --base-url "http://127.0.0.1:$PORT" --num-prompts 256 --input-len 256 \
    --output-len 256 --request-rate "$rate" --seed "$seed" --json-out "$OUT/serve_rate_$name.json" 2>&1 | tee "$OUT/serve_rate_$name.log"
  (( ${#spies[@]} )) && wait "${spies[@]}"  # not a bare wait: the server is a job of this shell too
  api1=$(cpu_ticks $server); eng1=$(cpu_ticks $engine); t1=$(date +%s.%N)
  awk -v a=$((api1 - api0)) -v e=$((eng1 - eng0)) -v hz=$TICK -v w="$t1 - $t0" -v r=$name 'BEGIN {
    split(w, x, " - "); wall = x[1] - x[2];
    printf "rate %s: %.2f s wall; CPU busy: API process %.0f%%, engine process %.0f%% (of one core)\n",
      r, wall, 100 * a / hz / wall, 100 * e / hz / wall }' | tee -a "$OUT/serve_cpu.txt"
  # The engine process's busiest threads over this rate (a thread gone meanwhile is left out).
  thread_ticks $engine | awk -v hz=$TICK -v w="$t1 - $t0" 'NR == FNR {before[$1] = $NF; next}
    ($1 in before) {split(w, x, " - "); busy = ($NF - before[$1]) / hz / (x[1] - x[2]);
      if (busy >= 0.05) {$NF = ""; printf "  engine thread %s: %.0f%%\n", $0, 100 * busy}}' "$OUT/threads0" - |
    sort -t: -k2 -rn | head -n 6 | tee -a "$OUT/serve_cpu.txt"
done
if grep -qE "Failed requests: +[1-9]|test run failed" "$OUT"/serve_rate_*.log; then
  echo "=== requests failed; the server's log ends:"; grep -v -i warn "$OUT/server.log" | tail -n 60
fi
kill $server; wait $server 2>/dev/null
for run in $(seq "${OFFLINE_RUNS:-1}"); do  # OFFLINE_RUNS=2: a second engine, for the spread
  log=$OUT/offline_throughput.log; (( run > 1 )) && log=$OUT/offline_throughput_$run.log
  $PY -m flexengine.cli bench throughput --model "$MODEL_DIR" --dtype bfloat16 ${ENGINE_ARGS---async-scheduling} --num-prompts 256 --input-len 256 \
    --output-len 256 --temperature 0 2>&1 | tee "$log"
done
echo "=== serving vs offline"
grep -hE "Output token throughput|Median TPOT" "$OUT"/serve_rate_*.log
grep -h "Throughput:" "$OUT"/offline_throughput*.log
cat "$OUT/serve_cpu.txt"
grep -h "engine: " "$OUT/server.log" | tail -n 8  # the engine loop's own stats
