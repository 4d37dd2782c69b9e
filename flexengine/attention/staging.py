"""Host→device copies of a step's small arrays: from a ring of pinned slots on CUDA, so that they do not block
the host and no step pins fresh memory."""
from __future__ import annotations

import functools

import numpy as np
import torch


def to_device(array: np.ndarray, device) -> torch.Tensor:
    """One host→device copy, from pinned memory on CUDA so that it does not block the host."""
    t = torch.from_numpy(array)
    device = torch.device(device)
    if device.type != "cuda":
        return t
    if torch.cuda.is_current_stream_capturing() or t.nbytes > PinnedStaging.SLOT_BYTES:
        return t.pin_memory().to(device, non_blocking=True)
    return staging(device).copy(t)


def copy_into(array: np.ndarray, buffer: torch.Tensor, device) -> None:
    """to_device, into the start of an existing buffer (a CUDA graph's static input) on `device`."""
    t = torch.from_numpy(array)
    dst = buffer[: t.numel()].view(t.shape)
    device = torch.device(device)
    if device.type != "cuda":
        dst.copy_(t)
    elif torch.cuda.is_current_stream_capturing() or t.nbytes > PinnedStaging.SLOT_BYTES:
        dst.copy_(t.pin_memory(), non_blocking=True)
    else:
        staging(device).copy(t, out=dst)


class PinnedStaging:
    """A ring of preallocated pinned slots for small host→device copies. Pinning fresh memory for each
    copy (`pin_memory()`) took 12% of the server engine's host time on the H100 box (py-spy). A slot
    is written again only after the copy that last read it has run (an event per slot)."""
    SLOTS, SLOT_BYTES = 32, 1 << 20

    def __init__(self, device: torch.device):
        self.device = device
        self.buffer = torch.empty(self.SLOTS * self.SLOT_BYTES, dtype=torch.uint8, pin_memory=True)
        self.copied: list[torch.cuda.Event | None] = [None] * self.SLOTS
        self.next = 0

    def copy(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """t on the device: a new tensor, or written into `out`."""
        i, self.next = self.next, (self.next + 1) % self.SLOTS
        if self.copied[i] is not None:
            self.copied[i].synchronize()  # long done, unless SLOTS copies are still queued
        start = i * self.SLOT_BYTES
        slot = self.buffer[start:start + t.nbytes].view(t.dtype).view(t.shape)
        slot.copy_(t)
        if out is None:
            out = slot.to(self.device, non_blocking=True)
        else:
            out.copy_(slot, non_blocking=True)
        self.copied[i] = self.copied[i] or torch.cuda.Event()
        self.copied[i].record()
        return out


@functools.cache
def staging(device: torch.device) -> PinnedStaging:
    return PinnedStaging(device)
