"""The tensor-parallel group: this process's rank, the group size and the process groups.

One process per rank. The engine's process is rank 0; `init_tensor_parallel` joins the
torch.distributed group (NCCL on CUDA, gloo on CPU) and makes it this process's group. Layers read
`tp_rank()` / `tp_size()` / `tp_group()` once, when they are built, and keep them: at size 1 (no group,
the default) every layer is the plain one and no collective ever runs.

Two process groups: `device` carries the model's collectives (all-reduce, all-gather, the input ids'
broadcast), NCCL on GPUs; `control` is always gloo: the barrier at shutdown, and, where torchrun started
the ranks, rank 0's pickled step descriptions (spawned workers get theirs down a pipe), with a long timeout
because a worker waits on it while the engine is idle.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# A worker waits on the control group between steps, however long the engine is idle; a dead rank 0
# closes its sockets, which ends that wait at once (gloo reports the closed connection).
CONTROL_TIMEOUT = datetime.timedelta(days=7)
# The model's collectives: generous, because the ranks compile (and capture graphs) side by side at start-up.
DEVICE_TIMEOUT = datetime.timedelta(minutes=30)


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    device: Any = None    # torch.distributed ProcessGroup of the model's collectives (None at size 1)
    control: Any = None   # gloo ProcessGroup of the step descriptions (None at size 1)
    backend: str | None = None

    @property
    def is_driver(self) -> bool:
        """Rank 0: owns the scheduler, samples, and tells the workers what to run."""
        return self.rank == 0


SINGLE = TPGroup()
_current = SINGLE


def tp_rank() -> int:
    return _current.rank


def tp_size() -> int:
    return _current.size


def tp_group() -> TPGroup:
    return _current


def backend_for(device: torch.device) -> str:
    """FLEXENGINE_DIST_BACKEND when set (checked at start-up), else NCCL on CUDA and gloo on the CPU."""
    from ..config import env_dist_backend
    chosen = env_dist_backend()
    if chosen != "auto":
        return chosen
    return "nccl" if device.type == "cuda" else "gloo"


def init_tensor_parallel(rank: int, size: int, device: torch.device, init_method: str = "env://") -> TPGroup:
    """Join the group of `size` ranks (torch.distributed's world) as `rank`, and make it this process's."""
    global _current
    assert size > 1 and 0 <= rank < size, (rank, size)
    if _current.size > 1:
        raise RuntimeError(f"this process is already rank {_current.rank} of a tensor-parallel group of "
                           f"{_current.size}: close that engine before starting another")
    backend = backend_for(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kwargs = dict(device_id=device) if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=DEVICE_TIMEOUT,
                            **kwargs)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    _current = TPGroup(rank, size, dist.group.WORLD, control, backend)
    return _current


def destroy_tensor_parallel(peer_died: bool = False, timeout_s: float = 30.0) -> None:
    """Leave the group (idempotent); layers built for it must not run afterwards.

    NCCL's teardown is collective, and it waits until no CUDA graph that captured its calls is alive: every
    rank drops its graphs (ModelRunner.release_graphs) and then destroys, side by side. When a peer has died,
    a destroy would wait for it forever, so NCCL aborts instead. Either runs on a thread: a wedged NCCL is
    left behind with a warning after `timeout_s` rather than hanging the process."""
    global _current
    from . import one_shot
    one_shot.disable()  # its symmetric buffers belong to the group
    if not dist.is_initialized():
        _current = SINGLE
        return
    abort = peer_died and _current.backend == "nccl"
    leave = dist.distributed_c10d._abort_process_group if abort else dist.destroy_process_group
    thread = threading.Thread(target=leave, name="flexengine-leave-group", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        logger.warning("leaving the tensor-parallel group (%s) did not finish within %.0f s; going on without it",
                       "abort" if abort else "destroy", timeout_s)
    _current = SINGLE


@contextlib.contextmanager
def building_for(group: TPGroup):
    """Layers built inside shard for `group` (a TP=1 engine beside a TP=2 one in the same process builds
    with SINGLE)."""
    global _current
    saved, _current = _current, group
    try:
        yield
    finally:
        _current = saved
