"""Issue 20's four sampling workloads on one engine: one start-up on the GPU instead of four (each is about
a minute of device time). JSON schemas 1 and 16 and penalties at 256 x 256 x 256, prompt logprobs at
1,000 x 256 x 1; each writes the JSON `flexengine bench throughput` writes with its flag.

    python3 scripts/sampling_suite.py --model /dev/shm/llama1b --dtype bfloat16 --out bench_out

Each workload draws its prompts from a seed of its own, so no run reuses another's pages from the prefix cache.
"""
from __future__ import annotations

import argparse
import copy
import os

from flexengine.benchmarks import throughput
from flexengine.benchmarks.common import build_llm, compiled_graphs, random_prompts, warm_up

WORKLOADS = [  # (name, the bench throughput flags it stands for)
    ("json_schemas_1", dict(json_schemas=1)),                 # >= 0.85x unconstrained
    ("json_schemas_16", dict(json_schemas=16)),
    ("penalties", dict(penalties=True)),                      # >= 0.95x plain
    ("prompt_logprobs", dict(prompt_logprobs=1, num_prompts=1000, output_len=1)),  # >= 0.9x plain prefill
]
RUN = {"json_schemas": throughput.structured_main, "penalties": throughput.penalties_main,
       "prompt_logprobs": throughput.prompt_logprobs_main}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    throughput.add_arguments(p)
    p.add_argument("--out", required=True, help="directory for sampling_<workload>.json")
    p.add_argument("--only", default=None, help="comma-separated workload names (default: all four)")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    llm, build_s = build_llm(args)
    warm_up(llm, args.input_len, args.seed)
    print(f"# one engine for the suite: built in {build_s:.1f} s", flush=True)
    chosen = set(args.only.split(",")) if args.only else None
    for k, (name, flags) in enumerate(WORKLOADS):
        if chosen is not None and name not in chosen:
            continue
        run = copy.copy(args)
        vars(run).update(flags, seed=args.seed + 1000 * (k + 1), json_out=os.path.join(args.out, f"sampling_{name}.json"))
        prompts = random_prompts(run.num_prompts, run.input_len, llm.llm_engine.vocab_size, run.seed)
        print(f"=== {name}", flush=True)
        mode = next(key for key in RUN if flags.get(key))
        before = compiled_graphs()
        RUN[mode](run, llm, prompts)
        # start-up compiles every sampler graph: a compile here is a first request's stall (JSON's first round
        # may also compile its grammars, which dynamo does not count)
        print(f"Graphs compiled during {name}: {compiled_graphs() - before}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
