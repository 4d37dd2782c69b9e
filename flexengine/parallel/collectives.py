"""The model's collectives over the TP group's device process group.

Eager calls use torch.distributed's in-place ops; inside a compiled region (torch.compile traces the
layers on CUDA) the functional collectives, which Inductor schedules and a CUDA graph captures (an NCCL
collective runs on the current stream, so graph capture records it like any kernel).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over the ranks."""
    if torch.compiler.is_compiling():
        return funcol.all_reduce(x, "sum", group)
    dist.all_reduce(x, group=group)
    return x


def broadcast_from_first(x: torch.Tensor, group) -> torch.Tensor:
    """Rank 0's x on every rank."""
    if torch.compiler.is_compiling():
        return funcol.broadcast(x, 0, group)
    dist.broadcast(x, src=0, group=group)
    return x


def all_gather_last_dim(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """[..., n] on each rank → [..., size * n], rank r's part at columns [r * n, (r + 1) * n)."""
    x = x.contiguous()
    if torch.compiler.is_compiling():
        stacked = funcol.all_gather_tensor(x, 0, group)
        return torch.cat(stacked.chunk(size, dim=0), dim=-1)
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)  # the list form: gloo has no all_gather_into_tensor everywhere
    return torch.cat(parts, dim=-1)
