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
