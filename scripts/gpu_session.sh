#!/usr/bin/env bash
# One device call: install, then the named stages in order, under one time budget (a stage that no
# longer fits is skipped, and says so). Logs land in $OUT (or ./bench_out); a summary comes last.
#   bash scripts/gpu_session.sh stage...      BUDGET=seconds (default 560), ENGINE_ARGS="--flag value ..."
# Stages: tests (pytest -m gpu; TESTS="files" narrows it), tests_attention (the attention kernels' GPU tests), attention (kernel
# table; ATTN_ARGS adds arguments, here and in the next two), attention_workspace (the same with 128-token pages copied into
# the workspace), attention_window (the same with sliding_window(1024) + softcap(30)), compare (flexengine vs
# transformers generate_batch, 256 x 256 x 256), prompt_heavy (the same, 64 x 2048 x 16), long (16 x 6144 x
# 256), long_context (8k-64k prompts' prefill vs transformers' forward), profile_long (one 64k prefill's
# kernels), throughput, latency (batch 1), eager (throughput and latency with --enforce-eager), sync (the same
# two without async scheduling), serve
# (scripts/serve_bench.sh), profile (scripts/profile_step.py, with PROFILE_ARGS), startup (scripts/startup_time.py twice:
# a first start with empty compile caches, then a second that reads them), startup_kernels (a fresh start with every
# Triton kernel compiled in the main process, listed by compile seconds: what a fresh box waits for),
# startup_ab (fresh starts on one box, each with its own empty caches, in the order STARTUP_AB gives, default "base
# new": "new" is this tree, any other NAME the commit archived in .NAME.tgz, carried; `git archive REV | gzip`; an entry
# NAME:--flag=value,--flag passes startup_time.py those switches for that start, e.g.
# "new new:--knobs=zero_first_deltas=1,down_split_rows=0"), prefill_symbolic
# (scripts/prefill_dynamic_probe.py, PROBE_ARGS: the Triton prefill call per bucket against one compile for a symbolic
# tile count, the default; that path's GPU tests; a fresh start with a compile per bucket), decode_symbolic (unsplit
# decode rows with query heads as rows, compiled once for a symbolic row count: the probe's decode cases for the decode
# template per bucket, heads as rows per bucket and that one compile; its GPU test, a fresh start with it), metadata_probe
# (scripts/decode_metadata_probe.py: the decode graphs' metadata eager against compiled), host
# (scripts/step_host_time.py: host time of each step's inputs), host_mixed (the same at a 2,048-token budget, so the
# steps with prompt tokens run from the mixed graphs, with a cProfile of the run), host_base (the host stage's table, HOST_ARGS or a 2,048-token budget, for
# the commit archived in .base.tgz, `git archive REV | gzip > .base.tgz`, carried (run's carry: [".base.tgz"]), on
# the same box; then this tree again),
# host_sampling (the same for issue 20's JSON and
# penalties workloads beside plain sampling, with each step's host busy time against its wall), softcap (scripts/softcap_probe.py at 128-token pages for each of TANH_FORMS, default "engine"; SOFTCAP_ARGS adds arguments), fa4_tiles (scripts/fa4_tile_probe.py, after fa4: FA4's 128- against 192-row q tiles at head size 64; TILE_ARGS), grammar_probe (scripts/grammar_fill_probe.py: xgrammar's fill and accept
# per step by thread count), gemv (scripts/gemv_probe.py: the batch-1 projections through cuBLAS and a Triton GEMV), one_row (batch 1 with and without
# layers/gemv.py's kernels, scripts/one_row_parts.py, ONE_ROW_VARIANTS: parts lists or none), small_batches (bench
# latency at batch 8 and 32), gemv_rows (gemv_probe.py: the few-rows kernel against cuBLAS at 8 and 32 rows),
# small_batch_leads (at SMALL_BATCHES, default "8 32": the default, scripts/kv_write_autotune.py,
# FLEXENGINE_SPLIT_KV=kernel, one_row_parts.py's "rows"; Inductor's source of the rotary + KV-write kernel),
# decode_tiles (flex's decode tile options, DECODE_VARIANTS of scripts/decode_step_probe.py: the attention
# table's decode rows (with ATTN_ARGS, e.g. "--head-dim 64 --decode-cases 32x256,32x4096"), then bench latency at SMALL_BATCHES, for each),
# buckets_ab (bench latency at BUCKET_BATCHES, default "96 192", on 256-request engines, alternating BUCKET_VARIANTS
# of decode_step_probe.py: each batch on its own decode bucket, then on the next power of two's),
# decode_variants (bench latency at SMALL_BATCHES
# for each of DECODE_STEP_VARIANTS, decode_step_probe.py's option lists; default "default default,combo_up_to=32": combo
# kernels in the batch-1 graph only, then up to batch 32), throughput_tiles (256^3 bench throughput per
# THROUGHPUT_VARIANTS of decode_step_probe.py, default "none default": flex's own decode tiles, then the engine's), pdl (FLEXENGINE_PDL off and on: latency at batch 1, 8, 32 (PDL_BATCHES) and 256^3
# throughput, 4,096-token engines), splits
# (scripts/decode_splits_probe.py: batch 1 and 8 decode, split-KV as chosen against one split), fa4
# (install the carried FlashAttention-4, smoke-test it, run the flash backend's GPU tests, ~100 s, which FA4_TESTS=0
# skips; later stages run with it, or without it where it failed), flash (throughput and latency with FA4 on the path:
# --attention-backend flex, auto, flash), sampling (issue 20's sampling targets on one engine, scripts/sampling_suite.py: what `bench throughput`
# gives with --json-schemas 1 and 16 and --penalties at 256 x 256 x 256, and --prompt-logprobs 1 at 1000 x 256 x 1;
# JSON in $OUT/sampling_*.json; the carried xgrammar, apache-tvm-ffi and what else the box lacks go to
# /tmp/sampling_site, on the path of this run only), tp2, tp2_tests and tp2_speed (issue 23, on two GPUs: the llama-3.1-8b-shaped checkpoint in $MODEL8B_DIR; tp2:
# scripts/tp_parity.py --speed (parity beside bf16's own noise, batch-1 ms/token, 256^3 tokens/s and decode profiles,
# one engine per size, then TP=2 on NCCL's all-reduce and TP=2 with split-KV off (TP2_VARIANTS replaces these), ~450 s); tp2_tests: the two-GPU
# tests (a call of their own); tp2_probe: scripts/all_reduce_probe.py (one sum inside a CUDA graph: the one-shot
# kernel, torch's op, NCCL) and the one-shot kernel's two-GPU test; tp2_speed (the same numbers through `flexengine bench`): batch-1 latency and 256 x 256 x 256 throughput at TP=1
# and TP=2, then a profile of TP=2 decode steps with the all-reduces' share). The end-to-end stages run scripts/e2e_bench.sh, which holds their commands (and takes ENGINE_ARGS).
# Stages that need the Llama-3.2-1B-shaped checkpoint make it first, once, in $MODEL_DIR. At the end
# everything in $OUT is packed into $OUT/logs.tgz (the device tool brings back at most 8 files). SAVE_CACHE=1 also
# leaves the box's compile caches there, which a later call carries in .gpu_cache/ (see below).
set -u
if (( $# == 0 )); then  # (it ran `tests attention compare latency` once: a call's whole budget, unasked)
  echo "usage: bash scripts/gpu_session.sh STAGE... (e.g. fa4 tests attention compare latency; see the top of this file)" >&2
  exit 2
fi
# The checkpoint goes to /dev/shm when it has room: writing 2.5 GB to the box's disk took about a minute.
SHM_FREE_KB=$(df -Pk /dev/shm 2>/dev/null | awk 'NR==2 {print $4}')
if (( ${SHM_FREE_KB:-0} > 8000000 )); then DEFAULT_MODEL_DIR=/dev/shm/llama1b; else DEFAULT_MODEL_DIR=/tmp/llama1b; fi
OUT=${OUT:-bench_out}; MODEL_DIR=${MODEL_DIR:-$DEFAULT_MODEL_DIR}; BUDGET=${BUDGET:-560}
export OUT MODEL_DIR PYTHONUNBUFFERED=1
# NVLink multicast stays off (the device tool's KINDS.md: it can take a shared host's GPUs out of service);
# the box sets these, and the tensor-parallel workers inherit them from here too
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT"
START=$(date +%s); STATUS=()
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
# attn-gym (a dev extra; pure Python) for its mods' GPU tests: carried as .whl/attn_gym-*.whl (scripts/serve_wheels.sh)
ls .whl/attn_gym-*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-deps .whl/attn_gym-*.whl >>"$OUT/install.log" 2>&1
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, '| transformers', transformers.__version__, '| triton', triton.__version__, '|', torch.cuda.get_device_name())"

# Compile caches carried from an earlier call (SAVE_CACHE=1 leaves them in $OUT as compile_cache.tar.gz.NN; kept
# here in .gpu_cache/, run's carry: [".gpu_cache"]): a fresh box then reads the kernels it would compile (~100 s of
# its first engine at max_num_seqs 32). Steady-state timings do not depend on it; the startup stage's first start
# keeps its own empty caches, and cold-start lines read low on a box that restored them (the log says it did).
# The folders the engine compiles into (config.compile_cache_defaults: the image's own settings win), relative to /
CACHE_DIRS=$(python3 -c "import os; from flexengine.config import compile_cache_defaults as d; d(); print(*(os.path.
relpath(os.environ[k], '/') for k in ('TORCHINDUCTOR_CACHE_DIR', 'FLASH_ATTENTION_CUTE_DSL_CACHE_DIR')))")
echo "compile caches: /${CACHE_DIRS// / and /}"
if compgen -G ".gpu_cache/compile_cache.tar.gz.*" >/dev/null; then
  cat .gpu_cache/compile_cache.tar.gz.* | tar -xzf - -C / \
    && echo "compile caches restored from .gpu_cache ($(cd / && du -shc $CACHE_DIRS 2>/dev/null | tail -1 | cut -f1))" \
    || echo "compile caches in .gpu_cache did not unpack: compiling from scratch"
fi

# install_tree DIR: the package from DIR, editable (a base's archive, then this tree again), logged to install.log
install_tree() { python3 -m pip install -q --no-deps --no-build-isolation -e "$1" >>"$OUT/install.log" 2>&1; }

# step NAME CAP CMD...: CMD under min(CAP, budget left), output tee'd into $OUT/NAME.log
step() {
  local name=$1 cap=$2; shift 2
  local base=$name n=2
  while [[ -e "$OUT/$name.log" ]]; do name="${base}_run$n"; n=$((n + 1)); done  # a repeated stage keeps the first's log
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if (( left < 30 )); then STATUS+=("$name: SKIPPED (budget spent)"); return 1; fi
  (( cap > left )) && cap=$left
  echo "=== $name (timeout ${cap}s)"
  local t0=$(date +%s)
  timeout --kill-after=10 "$cap" "$@" 2>&1 | grep -v -E "Warning:|warnings\.warn|USDT|self\.profiler = " | tee "$OUT/$name.log" | tail -40
  local rc=${PIPESTATUS[0]}
  STATUS+=("$name: rc=$rc ($(( $(date +%s) - t0 ))s)")
  return "$rc"
}

MODEL8B_DIR=${MODEL8B_DIR:-/dev/shm/llama8b}
FA4_PATH=  # set by the fa4 stage once FlashAttention-4 imports and passes its smoke test

# (weights drawn on the GPU since session 39: 52-70 s on the CPU each fresh box; other weights than the CPU's draw, which
# no step time depends on, and every comparison with transformers reads the same checkpoint in the same call)
model() {
  [[ -f $MODEL_DIR/config.json ]] || step make_model 150 python3 -m flexengine.cli make-model --preset llama-3.2-1b \
    --out "$MODEL_DIR" --dtype bfloat16 --device cuda
}

# latency_4k B: `bench latency`'s arguments at batch B (128 in, 256 out) on a 4,096-token engine, which builds in
# seconds where the model's whole 131,072 takes minutes: the issue-16 stages build several engines a call
latency_4k() {
  echo --model "$MODEL_DIR" --dtype bfloat16 --max-model-len 4096 --max-num-seqs "$1" --batch-size "$1" \
    --input-len 128 --output-len 256 --num-iters 3
}

model8b() {  # 16 GB: /dev/shm of a two-GPU box has the room
  [[ -f $MODEL8B_DIR/config.json ]] || step make_model_8b 300 python3 -m flexengine.cli make-model --preset llama-3.1-8b \
    --out "$MODEL8B_DIR" --dtype bfloat16 --device cuda
}

# bench_tp KIND SIZE FLAGS...: flexengine bench KIND on the 8B checkpoint at tensor_parallel_size SIZE
bench_tp() {
  local kind=$1 size=$2; shift 2
  step "${kind}_tp$size" 280 python3 -m flexengine.cli bench "$kind" --model "$MODEL8B_DIR" --dtype bfloat16 -tp "$size" \
    "$@" ${ENGINE_ARGS:-} --json-out "$OUT/${kind}_tp$size.json"
}

# e2e STEP...: those steps of scripts/e2e_bench.sh, within the budget left
e2e() {
  local left=$(( BUDGET - ($(date +%s) - START) ))
  step "e2e_${1}" "$left" env STEPS="$*" BUDGET="$left" bash scripts/e2e_bench.sh
}

# carried_site DIR: the carried wheels (.whl/, scripts/serve_wheels.sh) that the box lacks or has older, in DIR
carried_site() {
  local newer
  rm -rf "$1"  # a warm box keeps the last call's
  compgen -G ".whl/*.whl" >/dev/null || return 0
  mapfile -t newer < <(python3 scripts/newer_wheels.py .whl/*.whl)
  (( ${#newer[@]} == 0 )) || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target "$1" "${newer[@]}"
}

for stage in "$@"; do
  case $stage in
    tests) carried_site /tmp/sampling_site >>"$OUT/install.log" 2>&1  # xgrammar for the JSON-mode tests, if carried
           step gpu_tests 520 env PYTHONPATH=/tmp/sampling_site${PYTHONPATH:+:$PYTHONPATH} python3 -m pytest -m gpu -v \
             -p no:randomly -rfs --tb=short --durations=15 ${TESTS:-tests} ;;  # TESTS="tests/a.py tests/b.py": those files
           # only; the slowest tests listed (four files took 424 s of a 1,800 s device budget in session 49)
    tests_attention) step gpu_tests_attention 300 python3 -m pytest -m gpu -q -p no:randomly -rf --tb=short \
           tests/test_paged_attention.py tests/test_gym_mods.py tests/test_metadata.py tests/test_custom_attention.py \
           tests/test_cuda_graphs.py ;;  # the kernels' correctness only (the whole GPU suite: tests)
    attention) step attention 300 python3 -m flexengine.benchmarks.attention ${ATTN_ARGS:-} --json "$OUT/attention.json" ;;
    attention_workspace) step attention_workspace 300 python3 -m flexengine.benchmarks.attention ${ATTN_ARGS:-} \
           --prefill-from workspace --json "$OUT/attention_workspace.json" ;;  # 128-token pages copied, as before
    attention_window) step attention_window 300 python3 -m flexengine.benchmarks.attention --mask sliding_window:1024 \
           --score softcap:30 ${ATTN_ARGS:-} --json "$OUT/attention_window.json" ;;  # issue 15: within 15% of causal
    compare) e2e compare_transformers ;;
    prompt_heavy) e2e compare_prompt_heavy ;;  # 64 x 2048 in x 16 out against transformers
    long) e2e compare_long ;;                  # 16 x 6144 in x 256 out against transformers
    long_context) e2e long_context ;;          # 8k-64k prompts' prefill against transformers' forward
    sweep) step flex_sweep 330 env ${FA4_PATH:+PYTHONPATH=$FA4_PATH} python3 scripts/flex_prefill_sweep.py \
           --json "$OUT/flex_sweep.json" ;;   # prefill kernel options (FA4 too after the fa4 stage)
    prompt_heavy_tp) model && step prompt_heavy_tp 200 python3 -m flexengine.cli bench throughput --model "$MODEL_DIR" \
           --dtype bfloat16 --num-prompts 64 --input-len 2048 --output-len 16 ${ENGINE_ARGS:-} ;;  # flexengine alone
    profile_long) model && step profile_long 200 python3 scripts/profile_long_prefill.py --model "$MODEL_DIR" \
           ${PROFILE_ARGS:-} ;;                # one 64k prompt: wall vs GPU busy, kernels by group
    throughput|latency) e2e "$stage" ;;
    eager) e2e latency_eager throughput_eager ;;
    sync) e2e throughput_sync latency_sync ;;  # without async scheduling (on by default from session 15)
    serve) step serve 300 bash scripts/serve_bench.sh ;;  # it makes the checkpoint itself
    fa4) step fa4 150 bash scripts/fa4_install.sh true && FA4_PATH=$(bash scripts/fa4_install.sh path) && \
           export PYTHONPATH="$FA4_PATH${PYTHONPATH:+:$PYTHONPATH}" && { [[ ${FA4_TESTS:-1} == 0 ]] || \
           step fa4_tests 150 python3 -m pytest -m gpu -q -p no:randomly -rs --tb=short tests/test_flash_backend.py; } ;;
           # once FA4 installs and passes its smoke test, every later stage runs with it (flex prefill on FA4)
    tests_fa4) step gpu_tests_fa4 300 python3 -m pytest -m gpu -q -p no:randomly -rs --tb=short \
           tests/test_paged_attention.py tests/test_gym_mods.py ;;  # both prefill kernels, mods under graphs
    flash) if [[ -z $FA4_PATH ]]; then STATUS+=("flash: SKIPPED (no working FA4; run the fa4 stage first)"); else
             for backend in flex auto flash; do  # auto: flash for steps with prompts, flex graphs for decode
               left=$(( BUDGET - ($(date +%s) - START) ))
               step "fa4_$backend" "$left" env PYTHONPATH="$FA4_PATH" OUT="$OUT/fa4_$backend" STEPS="throughput latency" \
                 BUDGET="$left" ENGINE_ARGS="${ENGINE_ARGS:-} --attention-backend $backend" bash scripts/e2e_bench.sh
             done; fi ;;
    host) model && step step_host_time "${HOST_CAP:-150}" python3 scripts/step_host_time.py --model "$MODEL_DIR" \
             ${HOST_ARGS:-} ;;  # issue 15, item 3 (HOST_ARGS="--max-model-len 4096 ...")
    host_mixed) model && step step_host_time_mixed 150 python3 scripts/step_host_time.py --model "$MODEL_DIR" \
             --max-num-batched-tokens 2048 --workload plain,plain --cprofile "$OUT/host_mixed.pstats" ;;  # mixed graphs
    host_base) model && [[ -f .base.tgz ]] || { echo "host_base: no .base.tgz (git archive REV | gzip > .base.tgz)"; continue; }
           rm -rf /tmp/base && mkdir -p /tmp/base && tar -xzf .base.tgz -C /tmp/base  # host_mixed's run on the base
           install_tree /tmp/base
           # (this tree's script and timers, on the base's package; HOST_ARGS as the host stage's, e.g. a budget)
           step step_host_time_base "${HOST_CAP:-150}" python3 "$PWD/scripts/step_host_time.py" --model "$MODEL_DIR" \
             ${HOST_ARGS:---max-num-batched-tokens 2048}
           install_tree . ;;
    host_sampling) model && { carried_site /tmp/sampling_site >>"$OUT/install.log" 2>&1  # (xgrammar, as sampling's)
           # issue 20: is a JSON or penalised step bound by the host or the device? One engine, 256 x 256 x 64 each
           step step_host_sampling 300 env PYTHONPATH=/tmp/sampling_site${PYTHONPATH:+:$PYTHONPATH} python3 \
             scripts/step_host_time.py --model "$MODEL_DIR" --output-len 64 --workload plain,json,penalties; } ;;
    startup) model && for run in first second; do  # issue 24: LLM(path) at the default max_model_len, twice on one box
             step "startup_$run" 250 python3 scripts/startup_time.py --cache-dir /tmp/startup_caches --model "$MODEL_DIR" \
               --dtype bfloat16 --sample-stacks ${ENGINE_ARGS:-}; done ;;  # the first run fills the (empty) caches,
           # the second reads them; each prints where its time went (phases, CuTe's and Triton's compiles, FA4's keys)
    startup_ab) model && for entry in ${STARTUP_AB:-base new}; do  # issue 24: fresh starts, each with empty caches,
             run=${entry%%:*} flags=  # NAME:--flag=value,--flag: startup_time.py's own switches for that start
             [[ $entry == *:* ]] && flags=${entry#*:} && flags=${flags//,--/ --}  # (a value keeps its commas)
             if [[ $run == new ]]; then tree=.; else  # of this tree ("new") and of archived commits (.NAME.tgz), on one box
               tree=/tmp/ab_$run && rm -rf "$tree" && mkdir -p "$tree" && tar -xzf ".$run.tgz" -C "$tree" \
                 || { echo "startup_ab: no .$run.tgz (git archive REV | gzip > .$run.tgz)"; continue; }
             fi
             install_tree "$tree"
             step "startup_ab_$run" 250 python3 "$PWD/scripts/startup_time.py" --cache-dir "/tmp/ab_caches_${run}_$RANDOM" \
               --model "$MODEL_DIR" --dtype bfloat16 --sample-stacks $flags ${ENGINE_ARGS:-}
           done
           install_tree . ;;
    startup_kernels) model && step startup_kernels 400 env TORCHINDUCTOR_COMPILE_THREADS=1 python3 scripts/startup_time.py \
             --model "$MODEL_DIR" --dtype bfloat16 --sample-stacks ${ENGINE_ARGS:-} ;;  # issue 24: a fresh start with every
           # Triton kernel compiled in the main process (serial: slower than a real start), listed by compile seconds
    prefill_symbolic) step prefill_dynamic_probe 200 python3 scripts/prefill_dynamic_probe.py ${PROBE_ARGS:-}
           step prefill_symbolic_tests 240 python3 -m pytest -m gpu -q -p no:randomly -rf --tb=short \
             tests/test_paged_attention.py -k engine_prefill
           model && step startup_per_bucket 250 env TORCH_LOGS=recompiles python3 scripts/startup_time.py \
             --prefill-per-bucket --model "$MODEL_DIR" --dtype bfloat16 --sample-stacks ${ENGINE_ARGS:-} ;;  # issue 24:
           # the prefill kernel compiled once (a symbolic tile count) against one per bucket, its GPU tests, and a fresh
           # start with a compile per bucket, each recompile's reason logged (what a fresh start compiles more than once)
    decode_symbolic) step decode_dynamic_probe 200 python3 scripts/prefill_dynamic_probe.py \
             ${PROBE_ARGS:---ways static,heads,symbolic --cases 256x1+4096,192x1+4096,128x1+4096,96x1+4096,64x1+4096,32x1+4096,16x1+4096,96x1+32768}
           step decode_symbolic_tests 240 python3 -m pytest -m gpu -q -p no:randomly -rf --tb=short \
             tests/test_paged_attention.py -k engine_decode_with_symbolic
           model && step startup_decode_symbolic 250 env TORCH_LOGS=recompiles python3 scripts/startup_time.py \
             --decode-symbolic --model "$MODEL_DIR" --dtype bfloat16 --sample-stacks ${ENGINE_ARGS:-} ;;  # issue 24:
           # unsplit decode rows as heads-as-rows compiled once for a symbolic row count (flex_kernels.DECODE_DYNAMIC):
           # the kernels per bucket against it (the buckets past the largest, which the engine captures first, run the
           # symbolic one), its GPU test, and a fresh start with it
    metadata_probe) model && step metadata_probe 200 python3 scripts/decode_metadata_probe.py --model "$MODEL_DIR" ;;
           # the decode graphs' metadata, eager against one Inductor graph: GPU µs, kernels, compile seconds
    softcap) for form in ${TANH_FORMS:-engine}; do  # what a softcap score mod costs in FA4, per tanh lowering
               step "softcap_$form" 200 python3 scripts/softcap_probe.py --page 128 --tanh "$form" ${SOFTCAP_ARGS:-}; done ;;
    fa4_tiles) step fa4_tiles 240 python3 scripts/fa4_tile_probe.py ${TILE_ARGS:-} ;;  # FA4's q tile at D = 64 (after fa4)
    splits) model && step decode_splits_probe 300 python3 scripts/decode_splits_probe.py --model "$MODEL_DIR" ;;
           # issue 16: small-batch decode with the engine's split-KV against one split, by context
    sampling) model && { carried_site /tmp/sampling_site >>"$OUT/install.log" 2>&1 ||
             STATUS+=("sampling: carried wheels failed to install (install.log); runs without them")
           # issue 20's four workloads on one engine (scripts/sampling_suite.py: one start-up, not four)
           step sampling_suite 480 env PYTHONPATH=/tmp/sampling_site${PYTHONPATH:+:$PYTHONPATH} python3 \
             scripts/sampling_suite.py --model "$MODEL_DIR" --dtype bfloat16 ${ENGINE_ARGS:-} --out "$OUT"; } ;;
    tp2) model8b && step tp2_parity 580 python3 scripts/tp_parity.py --model "$MODEL8B_DIR" -tp 2 --speed \
           ${TP2_VARIANTS---variant nccl:FLEXENGINE_ALL_REDUCE=nccl --variant no_split:FLEXENGINE_DECODE_SPLITS=1} \
           --json "$OUT/tp2_parity.json" ;;
           # parity and bf16's noise, then on the same engines batch 1, 256^3, profiles; then TP=2 with NCCL's
           # all-reduce instead of the one-shot sum (the default on peer-connected GPUs), and with split-KV off
    tp2_probe) step all_reduce_probe 120 python3 scripts/all_reduce_probe.py  # one sum's cost: the kernel, torch's, NCCL
           step one_shot_gpu_test 120 python3 -m pytest -m gpu -q -p no:randomly -rs --tb=short tests/test_one_shot.py ;;
    tp2_tests) step tp2_gpu_tests 540 python3 -m pytest -m gpu -q -p no:randomly -rs --tb=short -o faulthandler_timeout=480 \
           --durations=5 tests/test_tensor_parallel.py ;;  # a hang dumps the test process's stacks before the cap
    tp2_speed) model8b && { for size in 1 2; do bench_tp latency "$size" --max-num-seqs 1 --batch-size 1 --input-len 128 \
             --output-len 256; done   # issue 23: TP=2 >= 1.6x faster at batch 1
           for size in 1 2; do bench_tp throughput "$size" --num-prompts 256 --input-len 256 --output-len 256; done  # >= 1.3x
           step profile_tp2 240 python3 scripts/profile_step.py --model "$MODEL8B_DIR" -tp 2 --num-prompts 64 \
             --output-len 16 --decode-batches 1,256 --arrival-batch 0; } ;;  # the all-reduces' share of a decode step
    one_row) model && i=0 && for parts in ${ONE_ROW_VARIANTS:-norm,silu,head norm,silu,head,o,down,prefetch norm,silu,head norm,silu,head,o,down,prefetch}; do i=$((i+1))
             step "latency_one_row_${i}_${parts//,/+}" 150 python3 scripts/one_row_parts.py ${parts/none/} -- \
               $(latency_4k 1); done ;;  # issue 16: batch 1 with and without layers/gemv.py
    decode_tiles) model && for o in ${DECODE_VARIANTS:-none num_stages=3 num_stages=3,num_warps=4}; do  # flex's decode tiles
             step "attention_decode_${o//,/+}" 120 python3 scripts/decode_step_probe.py "$o" -- attention --decode-only \
               ${ATTN_ARGS:-}
             for b in ${SMALL_BATCHES:-8 32}; do step "latency_b${b}_decode_${o//,/+}" 120 python3 \
               scripts/decode_step_probe.py "$o" -- latency $(latency_4k "$b"); done; done ;;
    buckets_ab) model && for b in ${BUCKET_BATCHES:-96 192}; do  # issue 24: a batch between the powers of two on its own
             # bucket or on the next power's (compile/policy.py's DECODE_BUCKET_96, DECODE_BUCKET_STEP), alternating
             ab="default default,bucket_96=0,bucket_step=128"
             for o in ${BUCKET_VARIANTS:-$ab $ab}; do
             step "latency_b${b}_${o//,/+}" 200 python3 scripts/decode_step_probe.py "$o" -- latency \
               $(latency_4k "$b") --max-num-seqs 256; done; done ;;
    decode_variants) model && for b in ${SMALL_BATCHES:-8 32}; do for o in ${DECODE_STEP_VARIANTS:-default default,combo_up_to=32}; do
             step "latency_b${b}_${o//,/+}" 200 python3 scripts/decode_step_probe.py "$o" -- latency \
               $(latency_4k "$b"); done; done
           for d in /tmp/inductor_persistent_*; do [[ -d $d ]] && echo "$d: $(grep -rl rsqrt "$d" --include='*.py' \
             | xargs -r grep -l '@triton_heuristics.persistent_reduction' | wc -l) persistent norm kernels" \
             | tee -a "$OUT/summary_extra.txt"; done ;;  # (persistent_up_to=N: did Inductor take the one-pass form?)
    throughput_tiles) model && for o in ${THROUGHPUT_VARIANTS:-none default}; do  # 256^3 (THROUGHPUT_ARGS), 4,096-token engines
             step "throughput_${o//,/+}" 200 python3 scripts/decode_step_probe.py "$o" -- throughput --model \
               "$MODEL_DIR" --dtype bfloat16 --max-model-len 4096 ${THROUGHPUT_ARGS:---num-prompts 256 --input-len 256 --output-len 256}
           done ;;
    pdl) model && for b in ${PDL_BATCHES:-1 8 32}; do for v in off on; do  # FLEXENGINE_PDL off and on, batch by batch
             step "latency_pdl_b${b}_$v" 150 env FLEXENGINE_PDL=$v python3 -m flexengine.cli bench latency \
               $(latency_4k "$b"); done; done
         for v in off on; do step "throughput_pdl_$v" 200 env FLEXENGINE_PDL=$v python3 -m flexengine.cli bench \
             throughput --model "$MODEL_DIR" --dtype bfloat16 --max-model-len 4096 --num-prompts 256 --input-len 256 \
             --output-len 256; done ;;
    small_batches) model && for b in 8 32; do step "latency_batch_$b" 150 python3 -m flexengine.cli bench latency \
             $(latency_4k "$b"); done ;;  # issue 16: ms a step at batch 8 and 32
    gemv_rows) step gemv_rows 200 python3 scripts/gemv_probe.py --rows 8,32 --shapes 1b --engine-only \
             --json "$OUT/gemv_rows.json" ;;  # the few-rows kernel against cuBLAS, alone, at its best configuration
    small_batch_leads) model && for b in ${SMALL_BATCHES:-8 32}; do  # issue 16's batch-8/32 ratio: session 24's leads
             step "latency_b${b}_default" 150 python3 -m flexengine.cli bench latency $(latency_4k "$b")
             step "latency_b${b}_kv_write_autotuned" 150 python3 scripts/kv_write_autotune.py -- $(latency_4k "$b")
             step "latency_b${b}_split_kv_kernel" 150 env FLEXENGINE_SPLIT_KV=kernel python3 -m flexengine.cli bench \
               latency $(latency_4k "$b")  # (batch 32 splits nothing: a control)
             step "latency_b${b}_few_rows" 150 python3 scripts/one_row_parts.py norm,silu,head,o,down,prefetch,rows -- \
               $(latency_4k "$b"); done  # every projection on layers/gemv.py's few-rows kernel (FEW_ROWS)
           grep -rl "def triton_poi_fused_add_cat_floor_divide_index_put" "/tmp/torchinductor_$(whoami)" 2>/dev/null \
             | head -4 | while read -r f; do cp "$f" "$OUT/kv_write_kernel_$(basename "$f")"; done ;;
    decode_kernel) step decode_kernel_probe 240 python3 scripts/decode_kernel_probe.py --json "$OUT/decode_kernel.json" ;;
           # issue 16: one decode request's attention, flex's decoding template against its main one, by context
    gemv) step gemv_probe 450 python3 scripts/gemv_probe.py ${GEMV_ARGS:-} --json "$OUT/gemv.json" ;;  # issues 16, 23: cuBLAS vs a GEMV
    grammar_probe) model && { carried_site /tmp/sampling_site >>"$OUT/install.log" 2>&1  # issue 20: xgrammar's host time
           step grammar_probe 120 env PYTHONPATH=/tmp/sampling_site${PYTHONPATH:+:$PYTHONPATH} python3 \
             scripts/grammar_fill_probe.py --model "$MODEL_DIR"; } ;;
    profile) model && { carried_site /tmp/sampling_site >>"$OUT/install.log" 2>&1  # xgrammar for --decode-workload json
           step profile 240 env PYTHONPATH=/tmp/sampling_site${PYTHONPATH:+:$PYTHONPATH} python3 scripts/profile_step.py \
             --model "$MODEL_DIR" ${PROFILE_ARGS:-}; } ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
echo "=================== summary ($(( $(date +%s) - START ))s of ${BUDGET}s)"
printf '%s\n' "${STATUS[@]}" | tee "$OUT/summary.txt"
# The device returns at most 8 files from $OUT: everything travels as one archive.
tar -czf /tmp/gpu_session_logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/gpu_session_logs.tgz "$OUT/logs.tgz"
# SAVE_CACHE=1: this box's compile caches as parts of at most 15 MiB beside the logs (the device returns files of
# up to 16 MiB, 8 in all), if they fit the 64 MiB that a call carries with the working tree (3 parts)
SAVED=$(cd / && ls -d $CACHE_DIRS 2>/dev/null)
if [[ ${SAVE_CACHE:-0} == 1 && -z $SAVED ]]; then echo "compile caches: none of /${CACHE_DIRS// / and /} exists: not saved"
elif [[ ${SAVE_CACHE:-0} == 1 ]]; then
  tar -czf - -C / $SAVED | split -b 15m -d - "$OUT/compile_cache.tar.gz."
  parts=$(ls "$OUT"/compile_cache.tar.gz.* | wc -l)
  if (( parts > 3 )); then rm -f "$OUT"/compile_cache.tar.gz.*; echo "compile caches: $parts parts of 15 MiB, too many to carry: not saved"
  else echo "compile caches saved: $parts part(s) in \$OUT ($(du -shc "$OUT"/compile_cache.tar.gz.* | tail -1 | cut -f1)); keep them with"
       echo "  rm -rf .gpu_cache && mkdir .gpu_cache && cp FILES_AT/compile_cache.tar.gz.* .gpu_cache/"; fi
fi
