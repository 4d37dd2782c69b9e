#!/usr/bin/env bash
# One device call: install, GPU tests, benchmarks. Stages: tests, attention, e2e, serve (default: all
# but serve; a full run needs about 15 minutes, so split it over two calls of at most 10).
# Usage on the GPU machine: bash scripts/gpu_session.sh [stage...]; logs land in $OUT (or ./bench_out).
set -u
OUT=${OUT:-bench_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
stages=${*:-tests attention e2e}
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, '| transformers', transformers.__version__, '| triton', triton.__version__, '|', torch.cuda.get_device_name())"
for stage in $stages; do
  case $stage in
    tests)
      timeout 420 python3 -m pytest -m gpu -q -x -p no:randomly tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
    attention)
      timeout 300 python3 -m flexengine.benchmarks.attention --json "$OUT/attention.json" 2>&1 | grep -v Warning | tee "$OUT/attention.log" ;;
    e2e)
      timeout 400 bash scripts/e2e_bench.sh 2>&1 | tee "$OUT/e2e.log" ;;
    serve)
      timeout 420 bash scripts/serve_bench.sh 2>&1 | tee "$OUT/serve.log" ;;
  esac
done
