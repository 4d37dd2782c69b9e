"""Split-KV decode: merge each request's partial results by log-sum-exp and write them into the step's output.

A decode request of a long context is `S` flex rows, each over a slice of its pages (metadata.page_lists), so
that a few requests still fill the GPU. Their partial outputs are merged here. On CUDA one Triton launch does
the merge and the scatter to the request's token row: the merge as a compiled torch function was a 23 µs
reduction at one request of 4,096 tokens (S = 32), twice the attention kernel, and the scatter another launch
(scripts/attention_breakdown.py, docs/benchmarks.md, session 11). Elsewhere the same arithmetic runs in torch.
"""
from __future__ import annotations

import functools

import torch


def merge_splits(out_BSHD: torch.Tensor, lse_BSH: torch.Tensor) -> torch.Tensor:
    """Combine split-KV partial results by log-sum-exp (float32); an empty split has lse -inf and weight 0,
    and a request whose splits are all empty gets zeros."""
    m = lse_BSH.amax(1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse_BSH - m)
    total = w.sum(1).clamp_min(torch.finfo(w.dtype).tiny)
    return (w[..., None] * out_BSHD.float()).sum(1) / total[..., None]


def merge_splits_into(out_TND: torch.Tensor, dst_B: torch.Tensor, part_RND: torch.Tensor, lse_RN: torch.Tensor | None,
                      splits: int) -> None:
    """out[dst[b]] = merge of rows b*S .. b*S+S-1 of `part` [B*S, N, D] by their lse [B*S, N] (None: S is 1,
    a plain scatter); a row b with dst[b] < 0 (a padding request) is dropped."""
    R, N, D = part_RND.shape
    B = R // splits
    assert B * splits == R and dst_B.shape == (B,) and out_TND.shape[1:] == (N, D), (part_RND.shape, dst_B.shape)
    assert part_RND.stride(2) == 1 and out_TND.stride(2) == 1, "rows of D contiguous"
    assert lse_RN is not None or splits == 1
    if not out_TND.is_cuda:
        merged = part_RND if lse_RN is None else merge_splits(part_RND.view(B, splits, N, D), lse_RN.view(B, splits, N))
        keep = dst_B >= 0
        out_TND.index_copy_(0, dst_B[keep], merged[keep].to(out_TND.dtype))
        return
    import triton
    lse = part_RND if lse_RN is None else lse_RN  # (unread without HAS_LSE)
    _kernel()[(B, N)](out_TND, dst_B, part_RND, lse, out_TND.stride(0), out_TND.stride(1),
                      part_RND.stride(0), part_RND.stride(1), lse.stride(0), lse.stride(1),
                      S=splits, S_BLOCK=triton.next_power_of_2(splits), D=D, D_BLOCK=triton.next_power_of_2(D),
                      HAS_LSE=lse_RN is not None)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def merge(out, dst, part, lse, so_t, so_n, sp_r, sp_n, sl_r, sl_n,
              S: tl.constexpr, S_BLOCK: tl.constexpr, D: tl.constexpr, D_BLOCK: tl.constexpr, HAS_LSE: tl.constexpr):
        b, n = tl.program_id(0), tl.program_id(1)
        t = tl.load(dst + b).to(tl.int64)
        if t >= 0:
            s = tl.arange(0, S_BLOCK)
            d = tl.arange(0, D_BLOCK)
            rows = (b * S + s).to(tl.int64)
            keep = (s[:, None] < S) & (d[None, :] < D)
            x = tl.load(part + rows[:, None] * sp_r + n * sp_n + d[None, :], mask=keep, other=0.0).to(tl.float32)
            if HAS_LSE:
                l = tl.load(lse + rows * sl_r + n * sl_n, mask=s < S, other=float("-inf"))
                m = tl.max(l, 0)
                m = tl.where(m == float("-inf"), 0.0, m)  # every split empty: weights 0, output 0
                w = tl.exp(l - m)
                total = tl.maximum(tl.sum(w, 0), 1.1754943508222875e-38)
                o = tl.sum(w[:, None] * x, 0) / total
            else:
                o = tl.sum(x, 0)
            tl.store(out + t * so_t + n * so_n + d, o.to(out.dtype.element_ty), mask=d < D)

    return merge
