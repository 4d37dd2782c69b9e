"""Where the time of one long prompt's prefill goes, on a GPU box: wall time against GPU-busy time, the
steps it took, and the kernels that took the GPU time, grouped; then where the GPU waited: the idle time
before the first kernel, between kernels and after the last, the longest gaps with the kernels around them,
and the host calls that block on the device (synchronize, blocking copies): issue 24, the idle share of a 64k
prefill.

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


WINDOW = "generate"  # the profiled call's range
SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaFree")


def idle_report(prof, wall_start_us: float, wall_end_us: float, top: int = 8) -> None:
    """The GPU's idle time in the profiled window, by where it falls, and the host's blocking calls."""
    events = prof.events()
    kernels = sorted((e for e in events if is_kernel(e) and e.time_range.end > e.time_range.start),
                     key=lambda e: e.time_range.start)
    if not kernels:
        return
    before = kernels[0].time_range.start - wall_start_us
    after = wall_end_us - max(k.time_range.end for k in kernels)
    gaps, reach = [], kernels[0].time_range.end
    for prev, k in zip(kernels, kernels[1:]):
        if k.time_range.start > reach:
            gaps.append((k.time_range.start - reach, reach, prev.name, k.name))
        reach = max(reach, k.time_range.end)
    between = sum(g[0] for g in gaps)
    big = [g for g in gaps if g[0] >= 100]
    print(f"\n# GPU idle: {before / 1e3:.1f} ms before the first kernel, {between / 1e3:.1f} ms between kernels "
          f"({len(gaps)} gaps; {len(big)} of >= 100 us: {sum(g[0] for g in big) / 1e3:.1f} ms), "
          f"{after / 1e3:.1f} ms after the last")
    print("| gap us | at ms | kernel before | kernel after |")
    print("|---|---|---|---|")
    for us, at, a, b in sorted(gaps, reverse=True)[:top]:
        print(f"| {us:.0f} | {(at - wall_start_us) / 1e3:.1f} | {a[:60]} | {b[:60]} |")
    blocking = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith(SYNC_CALLS) \
                and not e.name.startswith("cudaMemcpyAsync"):
            blocking[e.name][0] += 1
            blocking[e.name][1] += e.time_range.end - e.time_range.start
    print("\n| host call blocking on the device | calls | ms |")
    print("|---|---|---|")
    for name, (n, us) in sorted(blocking.items(), key=lambda kv: -kv[1][1]):
        print(f"| {name} | {n} | {us / 1e3:.2f} |")


def is_kernel(e) -> bool:
    """A GPU kernel or copy, not a user annotation's range (record_function shows on the GPU's timeline too)."""
    return e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False) \
        and e.name != WINDOW


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
        with torch.profiler.record_function(WINDOW):
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
    engine.scheduler.schedule = schedule
    groups = collections.defaultdict(float)
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0.0) or 0.0
        if us and e.device_type == torch.autograd.DeviceType.CUDA and e.key != WINDOW:
            groups[kernel_group(e.key)] += us
    busy = sum(groups.values()) / 1e6
    print(f"# one {args.length}-token prompt: {wall:.3f} s wall (profiled), GPU busy {busy:.3f} s ({busy / wall:.0%}), "
          f"{steps} steps, {wall / steps * 1e3:.1f} ms per step; max_model_len {engine.max_model_len}, "
          f"token budget {engine.config.max_num_batched_tokens}")
    print("| kernels | GPU s | share of busy |")
    print("|---|---|---|")
    for name, us in sorted(groups.items(), key=lambda kv: -kv[1])[:14]:
        print(f"| {name} | {us / 1e6:.3f} | {us / 1e6 / busy:.0%} |")
    span = next((e for e in prof.events() if e.name == WINDOW and e.device_type == torch.autograd.DeviceType.CPU), None)
    if span is not None:
        idle_report(prof, span.time_range.start, span.time_range.end)


if __name__ == "__main__":
    main()
