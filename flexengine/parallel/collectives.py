"""The model's collectives over the TP group's device process group.

Eager calls use torch.distributed's in-place ops; inside a compiled region (torch.compile traces the
layers on CUDA) the functional collectives, which Inductor schedules and a CUDA graph captures (an NCCL
collective runs on the current stream, so graph capture records it like any kernel). With
the one-shot sum (FLEXENGINE_ALL_REDUCE: by default wherever the GPUs reach each other's memory), sums up to
8 MiB go through symmetric memory instead (parallel/one_shot.py).
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ..config import ALL_REDUCES, env_all_reduce
from . import one_shot

logger = logging.getLogger(__name__)


def choose_all_reduce(tp, dtype: torch.dtype, device: torch.device) -> None:
    """FLEXENGINE_ALL_REDUCE on this rank's runner (launch.check_tensor_parallel has refused one_shot off CUDA).
    Every rank decides alike (the same environment, the same GPUs), as one_shot.enable is collective."""
    choice = one_shot_or_nccl(tp.size, tp.rank, device)
    if choice in ("one_shot", "torch_one_shot"):
        one_shot.enable(tp.device, dtype, device, own=choice == "one_shot")
    if tp.is_driver and tp.size > 1 and device.type == "cuda":
        if choice == "nccl":
            how = "with NCCL" + (": not every pair of the GPUs has peer access" if env_all_reduce() == "auto" else "")
        elif choice == "one_shot":
            own_kib = one_shot.MAX_PROGRAMS * one_shot.BLOCK * dtype.itemsize >> 10
            how = f"in one shot through symmetric memory (flexengine's kernel up to {own_kib} KiB, torch's op above)"
        else:
            how = "in one shot through symmetric memory (torch's op)"
        logger.info("tensor parallelism sums up to %d MiB %s (FLEXENGINE_ALL_REDUCE=%s)",
                    one_shot.TORCH_OP_MAX_BYTES >> 20, how, "|".join(ALL_REDUCES))


def one_shot_or_nccl(size: int, rank: int, device: torch.device) -> str:
    """auto takes the one-shot sum on CUDA where every pair of the group's GPUs (cuda:first .. first + size - 1)
    reads the other's memory: on two H100s it made batch-1 decode 6% and 256^3 throughput 7% faster than NCCL
    (docs/benchmarks.md, session 18)."""
    choice = env_all_reduce()
    if size == 1 or device.type != "cuda" or choice == "nccl":
        return "nccl"
    if choice != "auto":
        return choice
    # rank 0's runner holds the engine's own device ("cuda", no index): the group made it the current one
    first = (device.index if device.index is not None else torch.cuda.current_device()) - rank
    gpus = range(first, first + size)
    reachable = all(torch.cuda.can_device_access_peer(a, b) for a in gpus for b in gpus if a != b)
    return "one_shot" if reachable else "nccl"


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over the ranks."""
    if one_shot.takes(x):
        return torch.ops.flexengine.one_shot_sum(x)
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
