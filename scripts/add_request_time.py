"""Host time of admitting one long prompt (`LLMEngine.add_request`: checks, sequence, detokenizer), which stands
before a long prompt's first kernel (issue 24: 16 ms of GPU idle before a 65,536-token prefill's first kernel).

    python3 scripts/add_request_time.py --model /tmp/tinyl [--length 65536 --repeats 5]

CPU engine, float32; prints the median and the range of `--repeats` admissions of random prompts, and a profile
of one.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np

from flexengine import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--length", type=int, default=65536)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    blocks = -(-(args.length + 1024) // 128) + 8
    llm = LLM(args.model, device="cpu", dtype="float32", max_model_len=args.length + 1024, block_size=128,
              num_kv_blocks=blocks, max_num_seqs=args.repeats + 1)
    engine, sp = llm.llm_engine, SamplingParams(max_tokens=1, temperature=0)
    rng = np.random.default_rng(0)
    times = []
    for i in range(args.repeats):
        prompt = rng.integers(0, min(engine.vocab_size, 1000), args.length).tolist()
        start = time.perf_counter()
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, sp)
        times.append((time.perf_counter() - start) * 1e3)
        engine.abort_request(f"r{i}")
    times.sort()
    print(f"add_request, {args.length} prompt tokens: median {times[len(times) // 2]:.2f} ms "
          f"({times[0]:.2f}-{times[-1]:.2f}) over {args.repeats}")
    profile = cProfile.Profile()
    profile.enable()
    engine.add_request("profiled", {"prompt_token_ids": rng.integers(0, 1000, args.length).tolist()}, sp)
    profile.disable()
    pstats.Stats(profile).sort_stats("cumulative").print_stats(8)


if __name__ == "__main__":
    main()
