"""What the decode graphs' metadata costs per step, eager against one Inductor graph (issues 15 and 16).

    python3 scripts/decode_metadata_probe.py --model /dev/shm/llama1b [--batches 1,64,256]

A decode CUDA graph rebuilds the step's page map and page lists from the lengths and tables (about 80 small
ops on the CPU profile). Per batch bucket this prints the GPU time and kernel count of those ops captured as
they run today (eager, as the engine's graphs hold them), the same with the page lists and page map compiled
by Inductor (dynamic shapes), the compile's seconds (what it would add to start-up), and whether the two agree.
A probe for a decision, not a benchmark of the engine: the BlockMasks are built from these lists either way.
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from flexengine import LLM
from flexengine.attention.backends.paged_mods import param_values
from flexengine.attention.metadata import page_lists
from flexengine.compile.cuda_graphs import refresh_decode_positions
from flexengine.masks import MASK_ARGS


def lists(meta, mask_mod):
    """The tensors the decode graph rebuilds each step, for one mask (the BlockMasks are made of them)."""
    refresh_decode_positions(meta)
    return page_lists(meta, mask_mod, param_values(meta, mask_mod, MASK_ARGS))


def graph_us(fn, reps: int = 200) -> tuple[float, float, int, tuple]:
    """(µs per replay of fn captured in a CUDA graph, GPU busy µs, kernels per replay, its outputs)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / reps * 1e6
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if (getattr(e, "self_device_time_total", 0) or 0) > 0]
    busy = sum(e.self_device_time_total for e in kernels)
    return wall, busy, sum(e.count for e in kernels), out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--batches", default="1,64,256")
    args = p.parse_args()
    llm = LLM(args.model, dtype="bfloat16")
    runner = llm.llm_engine.runner
    graphs, mask_mod = runner.decode_graphs, runner.mods[0][0]
    compiled = torch.compile(lists, dynamic=True, fullgraph=True)
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | decode metadata per step, one mask")
    print("| batch | eager: µs per replay | GPU µs | kernels | compiled: µs per replay | GPU µs | kernels | "
          "compile s | same lists |")
    print("|---|---|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        for bs in map(int, args.batches.split(",")):
            bs = graphs.bucket_for(bs)
            meta = graphs.static_meta(bs)
            eager = graph_us(lambda: lists(meta, mask_mod))
            start = time.perf_counter()
            compiled(meta, mask_mod)
            compile_s = time.perf_counter() - start
            fast = graph_us(lambda: compiled(meta, mask_mod))
            same = all(torch.equal(a, b) for a, b in zip(eager[3], fast[3]))
            print(f"| {bs} | {eager[0]:.1f} | {eager[1]:.1f} | {eager[2]} | {fast[0]:.1f} | {fast[1]:.1f} | {fast[2]} | "
                  f"{compile_s:.1f} | {same} |")


if __name__ == "__main__":
    main()
