"""Batch 8 and 32's projections by weight layout and BLAS library (issue 16: at 32 rows cuBLAS reads the q/k/v and o
weights at ~45-50% of the bandwidth, gate/up at ~77%, down at ~62-69%; docs/benchmarks.md, sessions 24-29).

    python3 scripts/skinny_gemm_probe.py [--rows 8,32] [--autotune]

For each Llama-3.2-1B projection (q/k/v, o, gate/up, down) and row count, µs per call and the weight bytes read per
µs (TB/s), each call on another of 16 copies of the weight (so none is read from L2), 16 calls in one CUDA graph:
  linear     F.linear(x, W), W [N, K] as nn.Linear keeps it (the engine's call: cuBLAS's TN GEMM)
  kn         x @ Wt, Wt [K, N] contiguous (the weight transposed once at load: cuBLAS's NN GEMM)
  lt / lt kn the same two through cuBLASLt (torch.backends.cuda.preferred_blas_library)
  autotune   F.linear through Inductor's max-autotune GEMM templates (--autotune; compiles take a while)
A probe, not part of the engine.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from flexengine.benchmarks.attention import bench

SHAPES = {"q/k/v": (3072, 2048), "o": (2048, 2048), "gate/up": (16384, 2048), "down": (2048, 8192)}  # (N, K)
COPIES = 16


def graph_of(calls) -> torch.cuda.CUDAGraph:
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return graph


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="8,32")
    p.add_argument("--autotune", action="store_true")
    args = p.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    variants = ["linear", "kn", "lt", "lt kn"] + (["autotune"] if args.autotune else [])
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}; µs per call (TB/s of the weight)")
    print("| projection | rows | " + " | ".join(variants) + " |")
    print("|---|---|" + "---|" * len(variants))
    tuned = torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False) if args.autotune else None
    for name, (N, K) in SHAPES.items():
        weights = [torch.randn(N, K, device=dev, dtype=dt) * 0.02 for _ in range(COPIES)]
        transposed = [w.t().contiguous() for w in weights]
        for M in (int(m) for m in args.rows.split(",")):
            x = torch.randn(M, K, device=dev, dtype=dt)
            cells = []
            for v in variants:
                torch.backends.cuda.preferred_blas_library("cublaslt" if v.startswith("lt") else "cublas")
                if v == "autotune":
                    calls = [lambda w=w: tuned(x, w) for w in weights]
                elif v.endswith("kn"):
                    calls = [lambda w=w: x @ w for w in transposed]
                else:
                    calls = [lambda w=w: F.linear(x, w) for w in weights]
                us = bench(graph_of(calls).replay) / COPIES
                cells.append(f"{us:.1f} ({N * K * 2 / us / 1e6:.2f})")
            torch.backends.cuda.preferred_blas_library("cublas")
            print(f"| {name} | {M} | " + " | ".join(cells) + " |", flush=True)
        del weights, transposed


if __name__ == "__main__":
    main()
