"""Where the time of one long prompt's prefill goes, on a GPU box: wall time against GPU-busy time, the
steps it took, and the kernels that took the GPU time, grouped.

    python3 scripts/profile_long_prefill.py --model /tmp/llama1b [--length 65536] [--max-num-batched-tokens N]
"""
from __future__ import annotations

import argparse
import collections
import time

import torch
from torch.profiler import ProfilerActivity, profile

from flexengine import LLM, SamplingParams
from flexengine.benchmarks.common import random_prompts


def kernel_group(name: str) -> str:
    n = name.lower()
    for key, group in (("flex", "flex attention"), ("flash", "FA4 attention"), ("gemm", "GEMM"), ("nvjet", "GEMM"), ("cutlass", "GEMM"),
                       ("gather_pages", "workspace copy"), ("memcpy", "copies"), ("memset", "copies")):
        if key in n:
            return group
    return "other (" + name[:60] + ")"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--length", type=int, default=65536)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    args = p.parse_args()
    extra = {k: v for k, v in dict(max_num_batched_tokens=args.max_num_batched_tokens,
                                   max_model_len=args.max_model_len).items() if v}
    llm = LLM(args.model, dtype="bfloat16", **extra)
    engine = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    vocab = engine.vocab_size
    llm.generate([{"prompt_token_ids": random_prompts(1, 4096, vocab, 1)[0]}], sp, use_tqdm=False)
    prompt = random_prompts(1, args.length, vocab, 2)[0]
    steps = 0
    schedule = engine.scheduler.schedule

    def counting():
        nonlocal steps
        steps += 1
        return schedule()

    engine.scheduler.schedule = counting
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    engine.scheduler.schedule = schedule
    groups = collections.defaultdict(float)
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0.0) or 0.0
        if us and e.device_type == torch.autograd.DeviceType.CUDA:
            groups[kernel_group(e.key)] += us
    busy = sum(groups.values()) / 1e6
    print(f"# one {args.length}-token prompt: {wall:.3f} s wall (profiled), GPU busy {busy:.3f} s ({busy / wall:.0%}), "
          f"{steps} steps, {wall / steps * 1e3:.1f} ms per step; max_model_len {engine.max_model_len}, "
          f"token budget {engine.config.max_num_batched_tokens}")
    print("| kernels | GPU s | share of busy |")
    print("|---|---|---|")
    for name, us in sorted(groups.items(), key=lambda kv: -kv[1])[:14]:
        print(f"| {name} | {us / 1e6:.3f} | {us / 1e6 / busy:.0%} |")


if __name__ == "__main__":
    main()
