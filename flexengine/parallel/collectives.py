"""The model's collectives over the TP group's device process group.

Eager calls use torch.distributed's in-place ops; inside a compiled region (torch.compile traces the
layers on CUDA) the functional collectives, which Inductor schedules and a CUDA graph captures (an NCCL
collective runs on the current stream, so graph capture records it like any kernel). With
the one-shot sum (FLEXENGINE_ALL_REDUCE: by default wherever the GPUs reach each other's memory), small sums
go through torch's symmetric memory instead.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ..config import env_all_reduce

logger = logging.getLogger(__name__)


# FLEXENGINE_ALL_REDUCE=one_shot: sums up to this size read every rank's copy in one kernel (no NCCL ring, no
# multicast); larger ones stay on NCCL. 8 MiB is vLLM's bound for its symmetric-memory all-reduce at 2 ranks.
ONE_SHOT_MAX_BYTES = 8 << 20
_one_shot: tuple[torch.Tensor, str] | None = None  # (the symmetric buffer, the group's name) while enabled


def enable_one_shot(group, dtype: torch.dtype, device: torch.device) -> None:
    """Allocate and exchange the symmetric buffer (collective: every rank calls it at the same point)."""
    global _one_shot
    import torch.distributed._symmetric_memory as symm_mem
    buffer = symm_mem.empty(ONE_SHOT_MAX_BYTES // dtype.itemsize, dtype=dtype, device=device)
    symm_mem.rendezvous(buffer, group.group_name)
    _one_shot = (buffer, group.group_name)


def choose_all_reduce(tp, dtype: torch.dtype, device: torch.device) -> None:
    """FLEXENGINE_ALL_REDUCE on this rank's runner (launch.check_tensor_parallel has refused one_shot off CUDA).
    Every rank decides alike (the same environment, the same GPUs), as enable_one_shot is collective."""
    choice = one_shot_or_nccl(tp.size, tp.rank, device)
    if choice == "one_shot":
        enable_one_shot(tp.device, dtype, device)
    if tp.is_driver and tp.size > 1 and device.type == "cuda":
        logger.info("tensor parallelism sums up to %d MiB %s (FLEXENGINE_ALL_REDUCE=auto|nccl|one_shot)",
                    ONE_SHOT_MAX_BYTES >> 20, "in one shot through symmetric memory" if choice == "one_shot"
                    else "with NCCL: not every pair of the GPUs has peer access" if env_all_reduce() == "auto"
                    else "with NCCL")


def one_shot_or_nccl(size: int, rank: int, device: torch.device) -> str:
    """auto takes the one-shot sum on CUDA where every pair of the group's GPUs (cuda:first .. first + size - 1)
    reads the other's memory: on two H100s it made batch-1 decode 6% and 256^3 throughput 7% faster than NCCL
    (docs/benchmarks.md, session 18)."""
    choice = env_all_reduce()
    if size == 1 or device.type != "cuda" or choice == "nccl":
        return "nccl"
    if choice == "one_shot":
        return choice
    # rank 0's runner holds the engine's own device ("cuda", no index): the group made it the current one
    first = (device.index if device.index is not None else torch.cuda.current_device()) - rank
    gpus = range(first, first + size)
    reachable = all(torch.cuda.can_device_access_peer(a, b) for a in gpus for b in gpus if a != b)
    return "one_shot" if reachable else "nccl"


def disable_one_shot() -> None:
    global _one_shot
    _one_shot = None


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over the ranks."""
    if _one_shot is not None and x.dtype == _one_shot[0].dtype and x.numel() <= _one_shot[0].numel():
        buffer, name = _one_shot  # (the size is static in a compiled graph: the choice is made when it is traced)
        # the op wants the symmetric buffer in x's own shape: it copies x there, then reads every rank's copy
        return torch.ops.symm_mem.one_shot_all_reduce_copy(buffer[: x.numel()].view(x.shape), x.contiguous(),
                                                           "sum", name)
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
