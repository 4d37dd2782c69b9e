"""Issue 16, batch 8 and 32: `flexengine bench latency` with the layer's KV-writing region autotuned as the
other compiled regions are.

Session 24's profile (docs/benchmarks.md, call 1): at every batch from 8 to 256 the kernel that applies rotary to
the step's keys and stores its K/V into the pages takes about 7.8 µs a layer (125 µs a step at batch 8, 135 at 256),
where batch 1's combo kernel for the same work takes 2.4. `compile.policy.fused(writes_kv_cache=True)` gives that
region Inductor's default pointwise config, because autotuning it cost ~6 s of a cold start (session 20). This
times the step with the region's kernels autotuned instead; `scripts/gpu_session.sh small_batch_leads` runs it
beside the default and saves Inductor's source of that kernel:

    python3 scripts/kv_write_autotune.py -- --model DIR --batch-size 8 --max-num-seqs 8 ...

Session 25 (H100, call 1): no gain worth start-up time (batch 8 1.576 against 1.580 ms a step, batch 32 1.711 against
1.750). What made the kernel slow was its indexing: the cache's page size, heads and head size were run-time sizes,
each element's index divided by them in 64 bits; the region now compiles them as constants (compile/policy.py).
"""
from __future__ import annotations

import sys


def main() -> int:
    from flexengine.compile import policy
    compile_region = policy.compile_region
    policy.compile_region = lambda fn, combo, autotune_pointwise=True: compile_region(fn, combo, True)
    print("# the KV-writing region's pointwise kernels autotuned", flush=True)
    from flexengine.cli import main as cli
    split = sys.argv.index("--") if "--" in sys.argv else 0
    return cli(["bench", "latency", *sys.argv[split + 1:]])


if __name__ == "__main__":
    sys.exit(main())
