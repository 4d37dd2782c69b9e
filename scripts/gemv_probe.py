"""How fast the batch-1 decode step's projections read their weights: cuBLAS against a plain Triton GEMV
(issue 16: the qkv and o projections read at 1.3-1.9 TB/s in session 19's batch-1 profile).

    python3 scripts/gemv_probe.py [--rows 1,8] [--json out.json]

For each projection (qkv, o, gate_up, down, lm_head) of the Llama-3.2-1B and 3.1-8B shapes (8B also as one
rank's shards at TP=2) and each row count, µs per call
(calls captured in one CUDA graph, so no launch gaps, each on another copy of the weight, so that none is
read from L2), the weight bytes read per µs (TB/s), and the Triton
kernel's best configuration and its largest difference from cuBLAS. The GEMV: each program reads BLOCK_N rows of
the weight over a 1/SPLIT_K share of K and keeps its partial sums in float32; with SPLIT_K > 1 a second kernel sums the
splits (as cuBLAS's splitKreduce does), inside the same graph. A probe to decide whether the engine should carry its own
small-M GEMM, not part of the engine. The last column: the engine's one-row kernel
(flexengine/layers/gemv.py) with the decoder's residual sum and RMSNorm in its prologue, at the best configuration;
at more than one row, the engine's few-rows kernel (gemv.FEW_ROWS's rows_kernel) at its best of ROWS_CONFIGS. Runs
the kernels in Triton's interpreter on a CPU (correctness only).
"""
from __future__ import annotations

import argparse
import json
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read as the kernel is defined: the interpreter on a CPU
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from flexengine.benchmarks.common import graph_us  # noqa: E402
from flexengine.layers.gemv import _kernel as one_row_kernel  # noqa: E402
from flexengine.layers.gemv import _rows_kernel as rows_kernel  # noqa: E402

SHAPES = {  # (out features N, in features K) of each batch-1 projection
    "1b": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
           "lm_head": (128256, 2048)},  # Llama-3.2-1B
    "8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
           "lm_head": (128256, 4096)},  # Llama-3.1-8B at TP=1
    "8b_tp2": {"qkv": (3072, 4096), "o": (4096, 2048), "gate_up": (14336, 4096), "down": (4096, 7168),
               "lm_head": (64128, 4096)},  # one rank's shards at TP=2 (issue 23)
}
CONFIGS = [(bn, bk, s, w) for bn in (4, 8, 16) for bk in (512, 1024) for s in (1, 2) for w in (4, 8)]
ROWS_CONFIGS = [(bn, bk, w) for bn in (16, 32, 64) for bk in (64, 128, 256) for w in (4, 8)]
COLD_MB = 256  # enough weight copies to read per graph that none stays in L2 (50 MB on the H100)


@triton.jit
def gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, k_per_split, M: tl.constexpr, M_PAD: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[pid_k, m, n] = sum over this split's K of x[m, k] * w[n, k], float32 accumulation, stored in out's
    dtype (the result itself when there is one split)."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, M_PAD)
    acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    for k0 in range(pid_k * k_per_split, (pid_k + 1) * k_per_split, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
        x = tl.load(x_ptr + m[:, None] * K + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
        acc += tl.sum(x[:, None, :].to(tl.float32) * w[None, :, :].to(tl.float32), axis=2)
    tl.store(out_ptr + pid_k * M * N + m[:, None] * N + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(m[:, None] < M) & (n[None, :] < N))


def gemv_norm(r, d, nw, w, block_n: int, block_k: int, warps: int, eps: float = 1e-5) -> torch.Tensor:
    """The engine's one-row kernel (flexengine/layers/gemv.py) with the residual sum r + d and the RMSNorm in its
    prologue, at this configuration."""
    N, K = w.shape
    out = torch.empty(1, N, dtype=w.dtype, device=w.device)
    unused = r  # the rotary epilogue's pointers (ROPE off)
    one_row_kernel()[(triton.cdiv(N, block_n),)](r, d, r, nw, w, out, out, N, K, eps, *[unused] * 5, PROLOGUE=1,
                                                 HAS_A=True, HAS_B=False, WRITE_SUM=False, GATED=False, USE_PDL=False,
                                                 PREFETCH=0, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    return out


def engine_rows(x, w, block_n: int, block_k: int, warps: int) -> torch.Tensor:
    """The engine's few-rows kernel (flexengine/layers/gemv.py's rows_kernel, gemv.FEW_ROWS), launched plainly (no
    PDL, nothing prefetched), at this configuration."""
    (M, K), N = x.shape, w.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    rows_kernel()[(triton.cdiv(N, block_n),)](x, w, out, M, N, K, USE_PDL=False, PREFETCH=0,
                                              M_PAD=max(16, triton.next_power_of_2(M)), BLOCK_N=block_n,
                                              BLOCK_K=block_k, num_warps=warps)
    return out


@triton.jit
def split_sum_kernel(partial_ptr, out_ptr, numel, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """out = the sum of the SPLITS float32 partials, in out's dtype (what cuBLAS's splitKreduce does)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLITS):
        acc += tl.load(partial_ptr + s * numel + i, mask=i < numel, other=0.0)
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=i < numel)


def gemv(x: torch.Tensor, w: torch.Tensor, block_n: int, block_k: int, split_k: int, warps: int) -> torch.Tensor:
    M, K = x.shape
    N = w.shape[0]
    assert K % (split_k * block_k) == 0, (K, split_k, block_k)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    partial = out if split_k == 1 else torch.empty(split_k, M, N, dtype=torch.float32, device=x.device)
    gemv_kernel[(triton.cdiv(N, block_n), split_k)](x, w, partial, N, K, K // split_k, M=M,
                                                    M_PAD=max(2, triton.next_power_of_2(M)), BLOCK_N=block_n,
                                                    BLOCK_K=block_k, num_warps=warps)
    if split_k > 1:
        split_sum_kernel[(triton.cdiv(M * N, 1024),)](partial, out, M * N, SPLITS=split_k, BLOCK=1024)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1")
    p.add_argument("--shapes", default="1b,8b,8b_tp2", help=f"of {', '.join(SHAPES)}")
    p.add_argument("--json", default=None)
    p.add_argument("--engine-only", action="store_true",
                   help="skip the probe's own GEMV: cuBLAS against the engine's kernels only (a shorter run)")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    rows = [int(r) for r in args.rows.split(",")]
    g = torch.Generator(device=device).manual_seed(0)
    results = []
    if cuda:
        print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | bf16")
    print("| projection | N x K | rows | weight MB | cuBLAS µs | cuBLAS TB/s | Triton µs | Triton TB/s | best (BLOCK_N, "
          "BLOCK_K, SPLIT_K, warps) | max diff | Triton with the norm µs | few-rows kernel µs (BLOCK_N, BLOCK_K, "
          "warps) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    shapes = [(f"{model} {name}", nk) for model in args.shapes.split(",") for name, nk in SHAPES[model].items()]
    for name, (N, K) in shapes:
        if not cuda:
            N, K = min(N, 64), min(K, 1024)  # the interpreter is slow: small shapes, correctness only
        mb = N * K * 2 / 1e6
        copies = max(1, round(COLD_MB / mb)) if cuda else 1  # each call reads a weight not in L2, as in a model
        ws = [torch.randn(N, K, generator=g, device=device).to(dtype) * 0.02 for _ in range(copies)]
        calls = max(copies, 8)
        for M in rows:
            x = torch.randn(M, K, generator=g, device=device).to(dtype)
            want = torch.nn.functional.linear(x, ws[0])
            configs = CONFIGS if cuda else [(16, 512, 1, 4), (8, 256, 4, 4)]
            if args.engine_only:  # one configuration: the engine's one-row shape, for the norm column's M = 1
                configs = [(4, 1024, 1, 4) if cuda else (16, 512, 1, 4)]
            best = None
            for cfg in configs:
                if K % (cfg[1] * cfg[2]):
                    continue
                got = gemv(x, ws[0], *cfg)
                diff = (got.float() - want.float()).abs().max().item()
                assert diff <= 2e-2 * want.float().abs().max().item() + 1e-3, (name, M, cfg, diff)
                us = graph_us(lambda i: gemv(x, ws[i % copies], *cfg), calls)[0] if cuda else 0.0
                if best is None or us < best[0]:
                    best = (us, cfg, diff)
            blas = graph_us(lambda i: torch.nn.functional.linear(x, ws[i % copies]), calls)[0] if cuda else 0.0
            us, cfg, diff = best
            norm_us = None
            if M == 1 and cfg[2] == 1:  # the norm in the projection's prologue, at the best plain configuration
                r, d = x, torch.randn(1, K, generator=g, device=device).to(dtype)
                nw = (torch.rand(K, generator=g, device=device) + 0.5).to(dtype)
                hf = r.float() + d.float()
                ref = torch.nn.functional.linear(nw * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype), ws[0])
                got = gemv_norm(r, d, nw, ws[0], cfg[0], cfg[1], cfg[3])
                assert (got.float() - ref.float()).abs().max() <= 2e-2 * ref.float().abs().max() + 1e-3, name
                norm_us = graph_us(lambda i: gemv_norm(r, d, nw, ws[i % copies], cfg[0], cfg[1], cfg[3]), calls)[0] \
                    if cuda else 0.0
            rows_best = None  # the engine's few-rows kernel (M > 1), best configuration
            for rcfg in (ROWS_CONFIGS if cuda else [(16, 64, 4)]) if M > 1 else []:
                got = engine_rows(x, ws[0], *rcfg)
                assert (got.float() - want.float()).abs().max() <= 2e-2 * want.float().abs().max() + 1e-3, (name, rcfg)
                rus = graph_us(lambda i: engine_rows(x, ws[i % copies], *rcfg), calls)[0] if cuda else 0.0
                if rows_best is None or rus < rows_best[0]:
                    rows_best = (rus, rcfg)
            tbs = (lambda t: mb / t if t else 0.0)  # MB per µs = TB/s
            print(f"| {name} | {N} x {K} | {M} | {mb:.1f} | {blas:.1f} | {tbs(blas):.2f} | {us:.1f} | {tbs(us):.2f} "
                  f"| {cfg} | {diff:.2e} | {'' if norm_us is None else f'{norm_us:.1f}'} "
                  f"| {'' if rows_best is None else f'{rows_best[0]:.1f} {rows_best[1]}'} |")
            results.append(dict(name=name, N=N, K=K, rows=M, weight_mb=mb, cublas_us=blas, triton_us=us,
                                config=cfg, max_diff=diff, norm_us=norm_us,
                                rows_kernel_us=rows_best and rows_best[0], rows_kernel_config=rows_best and rows_best[1]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
