"""Fused projections: one matmul for q/k/v (or gate/up), loaded from the separate checkpoint tensors."""
from __future__ import annotations

from torch import nn


class MergedLinear(nn.Linear):
    """An nn.Linear whose output rows are the concatenation of named checkpoint projections.

    `shards` maps each checkpoint sub-module name (e.g. "q_proj") to its output size, in row order.
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shards = dict(shards)

    def shard_rows(self) -> dict[str, slice]:
        """Checkpoint sub-module name → the rows of this weight (and bias) it fills."""
        rows, start = {}, 0
        for name, size in self.shards.items():
            rows[name] = slice(start, start + size)
            start += size
        return rows

    def split_sizes(self) -> list[int]:
        return list(self.shards.values())
