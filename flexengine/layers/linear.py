"""Fused projections: one matmul for q/k/v (or gate/up), loaded from the separate checkpoint tensors."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .gemv import few_rows, gemv


class MergedLinear(nn.Linear):
    """An nn.Linear whose output rows are the concatenation of named checkpoint projections.

    `shards` maps each checkpoint sub-module name (e.g. "q_proj") to its output size, in row order.
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shards = dict(shards)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None and few_rows(x):  # a few decode rows: layers/gemv.py's kernel (FEW_ROWS)
            return gemv(x, self.weight)
        return F.linear(x, self.weight, self.bias)

    def shard_rows(self) -> dict[str, slice]:
        """Checkpoint sub-module name → the rows of this weight (and bias) it fills."""
        rows, start = {}, 0
        for name, size in self.shards.items():
            rows[name] = slice(start, start + size)
            start += size
        return rows

    def split_sizes(self) -> list[int]:
        return list(self.shards.values())


# Up to this many rows (past one), the MLP's down projection (bias-free, one GPU) leaves its product as two float32
# partial sums over the halves of K, which the next norm's kernel adds as it reads them: cuBLAS picks split-K for
# that shape and then reduces in a kernel of its own (1.8 µs a layer at 32 rows, session 37's profile). 0: off.
# H100, scripts/skinny_gemm_probe.py --split-k (session 38): down + residual sum + RMSNorm 19.8 -> 17.9 µs a layer at
# 32 rows, 19.0 -> 17.5 at 8. The regions then hold a comparison of the row count: one more graph each side of it
# (scripts/decode_step_probe.py down_split_rows=N times it in the engine). On from session 40, with DECODE_PARTIAL_ROWS:
# the pair -25 µs at 8 rows, ±0 to -35 at 32 (docs/benchmarks.md, sessions 39-40)
DOWN_SPLIT_ROWS = 32


def takes_down_split(x: torch.Tensor) -> bool:
    """Whether the down projection of x's rows leaves two partial sums (`down_split`): 2..DOWN_SPLIT_ROWS rows of a
    16-bit model on CUDA (the CPU and a switched-off DOWN_SPLIT_ROWS compare no dynamic row count)."""
    # the row count compared last: under dynamo a comparison of a symbolic size is a guard (and a graph each side)
    return (DOWN_SPLIT_ROWS > 1 and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and 1 < x.shape[0] <= DOWN_SPLIT_ROWS)


def down_split(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T as the float32 partial sums of K's two halves, [2, T, N] (no copy of either operand: strided
    batches); `summed` makes them the projection's output."""
    (T, K), N = x.shape, weight.shape[0]
    assert K % 2 == 0 and weight.shape[1] == K, (x.shape, weight.shape)
    xs, ws = x.view(T, 2, K // 2).transpose(0, 1), weight.t().view(2, K // 2, N)
    if x.is_cuda:
        return torch.bmm(xs, ws, out_dtype=torch.float32)
    return torch.bmm(xs.float(), ws.float())  # (bmm's out_dtype is CUDA's only; the CPU tests force this path)


def summed(delta: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A projection's output [T, N]: `down_split`'s partial sums added and rounded to the model's dtype (as cuBLAS
    rounds its own output), or the output itself."""
    if delta.dim() == 2:
        return delta
    # Two selects, not .sum(0): the regions compile dynamic in every size, and a reduction over a dimension of
    # unknown size is a kernel of its own, where two pointwise adds join the norm that reads them (session 43)
    return (delta[0] + delta[1]).to(dtype)
