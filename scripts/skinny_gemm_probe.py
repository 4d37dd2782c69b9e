"""Batch 8 and 32's projections by weight layout and BLAS library (issue 16: at 32 rows cuBLAS reads the q/k/v and o
weights at ~45-50% of the bandwidth, gate/up at ~77%, down at ~62-69%; docs/benchmarks.md, sessions 24-29).

    python3 scripts/skinny_gemm_probe.py [--rows 8,32] [--autotune]

For each Llama-3.2-1B projection (q/k/v, o, gate/up, down) and row count, µs per call and the weight bytes read per
µs (TB/s), each call on another of 16 copies of the weight (so none is read from L2), 16 calls in one CUDA graph:
  linear     F.linear(x, W), W [N, K] as nn.Linear keeps it (the engine's call: cuBLAS's TN GEMM)
  kn         x @ Wt, Wt [K, N] contiguous (the weight transposed once at load: cuBLAS's NN GEMM)
  lt / lt kn the same two through cuBLASLt (torch.backends.cuda.preferred_blas_library)
  autotune   F.linear through Inductor's max-autotune GEMM templates (--autotune; compiles take a while)
  bmm S      --split-k S,...: the product as S batched GEMMs over K's S shares (torch.bmm with a float32 out_dtype),
             the S partial sums left apart (as a norm or rotary kernel after it would add them while it reads them);
             "+sum" adds them in a kernel of its own
  chain      --split-k: o and down as the decoder runs them, F.linear then the residual sum and RMSNorm (one
             compiled region), against the S-way bmm with its partial sums added inside the norm's kernel
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
    p.add_argument("--split-k", default="", help="comma-separated split counts for the bmm variants, e.g. 2,4,8")
    args = p.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    splits = [int(s) for s in args.split_k.split(",") if s]
    variants = (["linear", "kn", "lt", "lt kn"] + (["autotune"] if args.autotune else [])
                + [f"bmm {S}{t}" for S in splits for t in ("", "+sum")])
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
                if v.startswith("bmm"):
                    S = int(v.split()[1].removesuffix("+sum"))
                    xs = x.view(M, S, K // S).transpose(0, 1)
                    calls = [lambda w=w: split_k(xs, w, S, v.endswith("+sum")) for w in weights]
                elif v == "autotune":
                    calls = [lambda w=w: tuned(x, w) for w in weights]
                elif v.endswith("kn"):
                    calls = [lambda w=w: x @ w for w in transposed]
                else:
                    calls = [lambda w=w: F.linear(x, w) for w in weights]
                us = bench(graph_of(calls).replay) / COPIES
                cells.append(f"{us:.1f} ({N * K * 2 / us / 1e6:.2f})")
            torch.backends.cuda.preferred_blas_library("cublas")
            print(f"| {name} | {M} | " + " | ".join(cells) + " |", flush=True)
        if splits and name in ("o", "down"):
            chain_rows(name, weights, [int(m) for m in args.rows.split(",")], splits)
        del weights, transposed


def split_k(xs: torch.Tensor, w: torch.Tensor, S: int, add: bool) -> torch.Tensor:
    """x @ w.T as S partial products over K's shares, float32: [S, M, N] (their sum [M, N] if `add`)."""
    N, K = w.shape
    part = torch.bmm(xs, w.t().view(S, K // S, N), out_dtype=torch.float32)
    return part.sum(0) if add else part


def add_norm(h: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder's residual sum and RMSNorm (float32 inside, the model's dtype out)."""
    r = h.float() + residual.float()
    normed = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.float()
    return normed.to(residual.dtype), r.to(residual.dtype)


def chain_rows(name: str, weights: list[torch.Tensor], rows: list[int], splits: list[int]) -> None:
    """µs per layer of (projection, residual sum, RMSNorm), compiled as the engine's regions are, cuBLAS's F.linear
    against S partial bmm products whose sum the norm's kernel takes in; and the largest difference of the normed
    output from the F.linear chain's (bf16 rounding of a float32 sum in another order)."""
    N, K = weights[0].shape
    gamma = torch.rand(N, device=weights[0].device, dtype=weights[0].dtype) + 0.5

    def plain(x, w, res):
        return add_norm(F.linear(x, w), res, gamma)

    def split(xs, w, res, S):
        return add_norm(torch.bmm(xs, w.t().view(S, K // S, N), out_dtype=torch.float32).sum(0), res, gamma)

    torch._dynamo.config.recompile_limit = 64  # one graph per (rows, S) and per weight's strides: a probe's few
    plain_c = torch.compile(plain, dynamic=False, fullgraph=True)
    split_c = torch.compile(split, dynamic=False, fullgraph=True)
    for M in rows:
        x = torch.randn(M, K, device=weights[0].device, dtype=weights[0].dtype)
        res = torch.randn(M, N, device=x.device, dtype=x.dtype)
        base = bench(graph_of([lambda w=w: plain_c(x, w, res) for w in weights]).replay) / COPIES
        ref = plain_c(x, weights[0], res)[0].float()
        cells = [f"linear+norm {base:.1f}"]
        for S in splits:
            xs = x.view(M, S, K // S).transpose(0, 1)
            us = bench(graph_of([lambda w=w: split_c(xs, w, res, S) for w in weights]).replay) / COPIES
            diff = (split_c(xs, weights[0], res, S)[0].float() - ref).abs().max().item()
            cells.append(f"bmm {S}+norm {us:.1f} (max diff {diff:.3g})")
        print(f"| chain {name} | {M} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
