"""The one-shot sum of small all-reduces (decode's: a few rows of the hidden size), flexengine's own kernel.

torch's symmetric-memory op (`symm_mem.one_shot_all_reduce_copy`) syncs the ranks twice per sum (before the reads,
and after them so that its buffer can be written again) and is launched without programmatic dependent launch; on
two H100s it took 9.4 µs per sum at batch 1, 612 µs of a 4.0 ms step of the 8B shape (docs/benchmarks.md,
session 26). parallel/one_shot_kernel.py syncs once, alternates two buffer slots instead of the second sync, and
waits on the device for the kernel before it, which starts the next kernel's launch early too.

`one_shot_sum(x)` is one custom op that decides at run time, not in a compiled graph's guards: sums up to
MAX_PROGRAMS * BLOCK elements take this kernel where it is enabled (FLEXENGINE_ALL_REDUCE=auto or one_shot), larger
ones (and every one under torch_one_shot) torch's op on its own symmetric buffer (both allocated by `enable`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..layers.gemv import launches_with_pdl

BLOCK = 1024           # elements a program sums (8 per thread at 4 warps: 16 bytes of bf16)
# sums up to 64 K elements (128 KiB of bf16: 16 rows of a 4096-wide model). On two H100s (scripts/all_reduce_probe.py,
# session 26) one row took 4.5 µs a sum here against 10.4 with torch's op, 8 rows 7.5 against 9.0, but 32 rows 12.4
# against 11.5: every program syncs on its own, so many programs cost more than they share
MAX_PROGRAMS = 64
FLAGS_BYTES_PER_RANK = MAX_PROGRAMS * 8
# larger sums up to this size take torch's op (no NCCL ring, no multicast); larger ones stay on NCCL. 8 MiB is vLLM's
# bound for its symmetric-memory all-reduce at 2 ranks.
TORCH_OP_MAX_BYTES = 8 << 20


@dataclass(frozen=True)
class Buffers:
    buffer: torch.Tensor    # this rank's symmetric buffer (uint8): the flags, then the two slots
    handle: object          # its symmetric memory handle: buffer_ptrs_dev is the device table of every rank's buffer
    counts: torch.Tensor    # [MAX_PROGRAMS] int64: each program's sums so far (its flag value and slot)
    dtype: torch.dtype
    rank: int
    world: int

    @property
    def flags_bytes(self) -> int:
        return FLAGS_BYTES_PER_RANK * self.world


_own: Buffers | None = None
_torch_op: tuple[torch.Tensor, str] | None = None  # torch's op: (its symmetric buffer, the group's name)


def enable(group, dtype: torch.dtype, device: torch.device, own: bool) -> None:
    """Allocate and exchange the symmetric buffers: torch's op's, and with `own` this kernel's. Every rank calls
    this at the same point (the rendezvous is collective)."""
    global _own, _torch_op
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem
    torch_buffer = symm_mem.empty(TORCH_OP_MAX_BYTES // dtype.itemsize, dtype=dtype, device=device)
    symm_mem.rendezvous(torch_buffer, group.group_name)
    _torch_op = (torch_buffer, group.group_name)
    if not own:
        _own = None
        return
    world = dist.get_world_size(group)
    flags_bytes = FLAGS_BYTES_PER_RANK * world
    buffer = symm_mem.empty(flags_bytes + 2 * MAX_PROGRAMS * BLOCK * dtype.itemsize, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(buffer, group.group_name)
    buffer.zero_()  # the flags start at 0 on every rank before any rank raises one
    torch.cuda.synchronize(device)
    dist.barrier(group)
    _own = Buffers(buffer, handle, torch.zeros(MAX_PROGRAMS, dtype=torch.int64, device=device), dtype,
                   dist.get_rank(group), world)


def disable() -> None:
    global _own, _torch_op
    _own = _torch_op = None


def takes(x: torch.Tensor) -> bool:
    """Whether the one-shot sum (either kernel) takes x: enabled, x in the buffers' dtype and within torch's buffer.
    (The size is static in a compiled graph: the choice is made when it is traced.)"""
    return _torch_op is not None and x.dtype == _torch_op[0].dtype and x.numel() <= _torch_op[0].numel()


def own_serves(x: torch.Tensor) -> bool:
    return _own is not None and x.dtype == _own.dtype and 0 < x.numel() <= MAX_PROGRAMS * BLOCK


@torch.library.custom_op("flexengine::one_shot_sum", mutates_args=())
def one_shot_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum of x over the ranks, read from every rank's copy in one kernel (x fits torch's buffer)."""
    x = x.contiguous()
    if own_serves(x):
        return _launch(x)
    buffer, name = _torch_op
    # the op wants the symmetric buffer in x's own shape: it copies x there, then reads every rank's copy
    return torch.ops.symm_mem.one_shot_all_reduce_copy(buffer[: x.numel()].view(x.shape), x, "sum", name)


@one_shot_sum.register_fake
def _(x):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@functools.cache
def _kernel():
    from .one_shot_kernel import one_shot_sum_kernel  # imports triton: only once a sum launches
    return one_shot_sum_kernel


def _launch(x: torch.Tensor) -> torch.Tensor:
    own = _own
    out = torch.empty_like(x)
    pdl = launches_with_pdl(x.device)
    _kernel()[(-(-x.numel() // BLOCK),)](
        x, out, own.handle.buffer_ptrs_dev, own.counts, x.numel(), FLAGS_BYTES=own.flags_bytes,
        SLOT=MAX_PROGRAMS * BLOCK, RANK=own.rank, WORLD=own.world, BLOCK=BLOCK, USE_PDL=pdl, num_warps=4,
        **({"launch_pdl": True} if pdl else {}))
    return out
