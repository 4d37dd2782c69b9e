"""Where the paged flex call's GPU time goes, on a GPU box: each kernel of `FlexBackend.forward` (replayed from a
CUDA graph, as the engine runs it) for the attention table's rows, by name, per call in µs.

    python3 scripts/attention_breakdown.py [--page 16] [--cases prefill8x1024,prefill32x512,decode1x4096]
"""
from __future__ import annotations

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from flexengine.benchmarks.attention import captured_flex_call, parse_mods

CASES = {"prefill8x1024": ([1024] * 8, [1024] * 8), "prefill2x4096": ([4096] * 2, [4096] * 2),
         "prefill32x512": ([512] * 32, [512] * 32), "decode1x4096": ([4096], [1]),
         "decode8x8192": ([8192] * 8, [1] * 8)}


def breakdown(seq_lens, query_lens, page, mods, Hq=32, Hkv=8, D=128, reps=20):
    graph, _ = captured_flex_call(seq_lens, query_lens, page, Hq, Hkv, D, torch.device("cuda"), mods)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    kernels = collections.defaultdict(float)
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0.0) or 0.0
        if us and e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.key[:90]] += us / reps
    return kernels


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--mask", default="causal")
    args = p.parse_args()
    mods = parse_mods(args.mask, None, 32)
    for name in args.cases.split(","):
        seq_lens, query_lens = CASES[name]
        kernels = breakdown(seq_lens, query_lens, args.page, mods)
        total = sum(kernels.values())
        print(f"## {name}, page {args.page}, mask {args.mask}: {total:.1f} µs of kernels per call")
        for k, us in sorted(kernels.items(), key=lambda kv: -kv[1]):
            print(f"  {us:8.1f} µs  {k}")


if __name__ == "__main__":
    main()
