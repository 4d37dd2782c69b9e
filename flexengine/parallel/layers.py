"""Megatron-style sharded layers. Each reads the TP group when it is built (state.tp_group()) and keeps
its rank's slice of the weight; at size 1 each is exactly the plain layer (same shapes, same ops, no
collective), so a TP=1 model runs what it ran before this module existed.

  QKVParallelLinear        column-parallel: rank r holds its query heads and its KV heads
                           (replicated when the model has fewer KV heads than ranks)
  MergedColumnParallelLinear  column-parallel gate/up: rank r holds its rows of each
  RowParallelLinear        input features split; one all-reduce of the output (bias added once)
  VocabParallelEmbedding   vocabulary rows split; ids outside the rank's rows give 0; one all-reduce
  gather_vocab             the logits' columns from every rank (the lm_head is vocabulary-parallel too)

`checkpoint_sources()` says which slice of each checkpoint tensor a rank reads (parallel/shard.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.gemv import few_rows, gemv, one_row
from ..layers.linear import MergedLinear
from .collectives import all_gather_last_dim, all_reduce
from .state import tp_group


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"tensor_parallel_size={parts} does not divide {what} ({total})")
    return total // parts


def kv_heads_of_rank(num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """(first KV head, how many) rank `rank` holds: an equal share, or the one KV head its query heads
    use when there are fewer KV heads than ranks (then size / num_kv_heads ranks hold a copy of each)."""
    if num_kv_heads >= size:
        n = divide(num_kv_heads, size, "the number of KV heads")
        return rank * n, n
    if size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={size} is more than the {num_kv_heads} KV heads and not a "
                         f"multiple of them, so the KV heads cannot be replicated evenly")
    return rank * num_kv_heads // size, 1


class QKVParallelLinear(MergedLinear):
    """q/k/v in one matmul, over this rank's query heads and KV heads."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool):
        tp = tp_group()
        D = head_dim
        self.num_heads = divide(num_heads, tp.size, "the number of attention heads")
        kv_first, self.num_kv_heads = kv_heads_of_rank(num_kv_heads, tp.rank, tp.size)
        self.head_offset = tp.rank * self.num_heads  # the global index of this rank's first query head
        super().__init__(hidden_size, {"q_proj": self.num_heads * D, "k_proj": self.num_kv_heads * D,
                                       "v_proj": self.num_kv_heads * D}, bias=bias)
        q0, k0 = self.head_offset * D, kv_first * D
        self.sources = {"q_proj": (num_heads * D, slice(q0, q0 + self.num_heads * D)),
                        "k_proj": (num_kv_heads * D, slice(k0, k0 + self.num_kv_heads * D)),
                        "v_proj": (num_kv_heads * D, slice(k0, k0 + self.num_kv_heads * D))}
        self.tp_size = tp.size

    def checkpoint_sources(self) -> dict[str, tuple[tuple[int, ...], tuple]]:
        return merged_sources(self)


class MergedColumnParallelLinear(MergedLinear):
    """Several column-parallel projections in one matmul (gate_proj and up_proj): rank r holds its
    1/size of each one's output rows."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool):
        tp = tp_group()
        local = {name: divide(size, tp.size, f"{name}'s output size") for name, size in shards.items()}
        super().__init__(in_features, local, bias=bias)
        self.sources = {name: (shards[name], slice(tp.rank * n, (tp.rank + 1) * n)) for name, n in local.items()}
        self.tp_size = tp.size

    def checkpoint_sources(self) -> dict[str, tuple[tuple[int, ...], tuple]]:
        return merged_sources(self)


def merged_sources(m: MergedLinear) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """{"q_proj.weight": (checkpoint shape, the rows this rank reads), ...}; {} at size 1 (read whole)."""
    if m.tp_size == 1:
        return {}
    out = {}
    for name, (rows, source) in m.sources.items():
        out[f"{name}.weight"] = ((rows, m.in_features), (source,))
        if m.bias is not None:
            out[f"{name}.bias"] = ((rows,), (source,))
    return out


class RowParallelLinear(nn.Linear):
    """y = x W^T + b with x's features (W's columns) split over the ranks: each rank's partial product,
    summed by one all-reduce; only rank 0 adds the bias."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        tp = tp_group()
        super().__init__(divide(in_features, tp.size, "the row-parallel input size"), out_features, bias=bias)
        self.full_in, self.tp_rank, self.tp_size, self.group = in_features, tp.rank, tp.size, tp.device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None and (one_row(x) or few_rows(x)):  # batch-1 decode: layers/gemv.py's kernel, which
            y = gemv(x, self.weight)  # PDL overlaps with its neighbours where cuBLAS's cannot be (1.300 → 1.230 ms)
        else:
            y = F.linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        return y if self.tp_size == 1 else all_reduce(y, self.group)

    def checkpoint_sources(self) -> dict[str, tuple[tuple[int, ...], tuple]]:
        if self.tp_size == 1:
            return {}
        n = self.in_features
        cols = slice(self.tp_rank * n, (self.tp_rank + 1) * n)
        return {"weight": ((self.out_features, self.full_in), (slice(None), cols))}  # the bias is whole


class VocabParallelEmbedding(nn.Embedding):
    """Rank r holds vocabulary rows [r * n, (r + 1) * n) with n = ceil(V / size); the last rank's rows
    past V are zero padding. The same weight serves as a tied lm_head (`gather_vocab`)."""

    def __init__(self, vocab_size: int, hidden_size: int):
        per_rank = split_vocab(self, vocab_size)
        super().__init__(per_rank, hidden_size)

    def zero_padding(self) -> None:
        """The padding rows (never looked up, logits cut off) hold zeros, not whatever memory held."""
        with torch.no_grad():
            self.weight[self.num_real:].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mine = (local >= 0) & (local < self.num_real)
        x = F.embedding(torch.where(mine, local, 0), self.weight)
        return all_reduce(torch.where(mine[:, None], x, 0), self.group)

    def checkpoint_sources(self) -> dict[str, tuple[tuple[int, ...], tuple]]:
        return vocab_sources(self)


class ParallelLMHead(nn.Linear):
    """The untied output projection, split over the vocabulary like VocabParallelEmbedding."""

    def __init__(self, vocab_size: int, hidden_size: int):
        per_rank = split_vocab(self, vocab_size)
        super().__init__(hidden_size, per_rank, bias=False)

    zero_padding = VocabParallelEmbedding.zero_padding

    def checkpoint_sources(self) -> dict[str, tuple[tuple[int, ...], tuple]]:
        return vocab_sources(self)


def split_vocab(m, vocab_size: int) -> int:
    """Set m's vocabulary share of this rank (start, num_real: its rows holding real tokens) and group;
    → rows per rank, ceil(V / size)."""
    tp = tp_group()
    m.vocab_size, m.tp_rank, m.tp_size, m.group = vocab_size, tp.rank, tp.size, tp.device
    per_rank = -(-vocab_size // tp.size)
    m.start = tp.rank * per_rank
    m.num_real = max(0, min(per_rank, vocab_size - m.start))
    return per_rank


def vocab_sources(m) -> dict[str, tuple[tuple[int, ...], tuple]]:
    if m.tp_size == 1:
        return {}
    return {"weight": ((m.vocab_size, m.weight.shape[1]), (slice(m.start, m.start + m.num_real),))}


def gather_vocab(logits: torch.Tensor, m) -> torch.Tensor:
    """[N, V / size] logits of this rank's vocabulary rows → [N, V] on every rank (an all-gather; every
    rank gets them so that a CUDA graph holding it is the same program on each)."""
    if m.tp_size == 1:
        return logits
    return all_gather_last_dim(logits, m.group, m.tp_size)[:, :m.vocab_size]
