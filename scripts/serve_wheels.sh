#!/usr/bin/env bash
# Fetch the wheels `flexengine serve` needs but the GPU box lacks (it has no network) into .whl/
# (git-ignored, carried to the box; serve_bench.sh installs those newer than the box's into /tmp/serve_site).
# Run on a machine with network. The box already has anyio, h11, click and httpx; fastapi 0.165
# imports opentelemetry-api at import time, so it comes along. xgrammar's other dependencies (torch,
# transformers, triton, numpy, pydantic, typing-extensions) are on the box or in this list.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -f .whl/*.whl  # exactly one version of each (fa4_install.sh's .whl/fa4.* stay)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d .whl \
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.13.4 pydantic-core==2.46.4 \
  annotated-types==0.7.0 typing-inspection==0.4.2 annotated-doc==0.0.7 opentelemetry-api==1.45.2 \
  typing-extensions==4.15.0 uvloop==0.23.0 httptools==0.9.0 \
  attn-gym==0.0.17 \
  xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 fastjsonschema==2.22.2
# uvicorn picks uvloop/httptools up by itself (+16% on CPU); attn-gym for the GPU tests of its mods; xgrammar
# (and apache-tvm-ffi, its one dependency the box lacks) for structured outputs (gpu_session.sh's sampling stage); fastjsonschema validates the JSON-mode GPU tests' outputs (the box has no rpds-py for jsonschema)
ls -1 .whl/*.whl
du -ch .whl/*.whl | tail -1
