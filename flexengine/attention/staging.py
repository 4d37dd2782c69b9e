"""Host→device copies of a step's small arrays: from a ring of pinned slots on CUDA, so that they do not block
the host and no step pins fresh memory."""
from __future__ import annotations

import functools

import numpy as np
import torch


def to_device(array: np.ndarray, device) -> torch.Tensor:
    """One host→device copy, from pinned memory on CUDA so that it does not block the host."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.from_numpy(array)
    if torch.cuda.is_current_stream_capturing() or array.nbytes > PinnedStaging.SLOT_BYTES:
        return torch.from_numpy(array).pin_memory().to(device, non_blocking=True)
    return staging(device).copy(array)


def copy_into(array: np.ndarray, buffer: torch.Tensor, device) -> None:
    """to_device, into the start of an existing 1-D buffer (a CUDA graph's static input) on `device`."""
    dst = buffer[: array.size]
    if array.ndim != 1:
        dst = dst.view(array.shape)
    if torch.device(device).type != "cuda":
        dst.copy_(torch.from_numpy(array))
    elif torch.cuda.is_current_stream_capturing() or array.nbytes > PinnedStaging.SLOT_BYTES:
        dst.copy_(torch.from_numpy(array).pin_memory(), non_blocking=True)
    else:
        staging(device).copy(array, out=dst)


class PinnedStaging:
    """A ring of preallocated pinned slots for small host→device copies. Pinning fresh memory for each
    copy (`pin_memory()`) took 12% of the server engine's host time on the H100 box (py-spy). A slot is
    written again only after the copy that last read it has run: an event per GROUP slots, recorded after the
    group's last copy. A slot is written through numpy (the pinned bytes' numpy view): on the H100 boxes' CPUs
    each torch view or slice of it cost 3.5-8 µs and each event record 5-12 µs (scripts/staging_probe.py)."""
    SLOTS, SLOT_BYTES, GROUP = 32, 1 << 20, 4

    def __init__(self, device: torch.device):
        self.device = device
        self.buffer = torch.empty(self.SLOTS * self.SLOT_BYTES, dtype=torch.uint8, pin_memory=True)
        self.host = self.buffer.numpy()  # the same pinned bytes
        self.copied: list[torch.cuda.Event | None] = [None] * (self.SLOTS // self.GROUP)
        self.next = 0

    def copy(self, array: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
        """`array` on the device: a new tensor, or written into `out`."""
        i, self.next = self.next, (self.next + 1) % self.SLOTS
        group, place = divmod(i, self.GROUP)
        if place == 0 and self.copied[group] is not None:
            self.copied[group].synchronize()  # the group's last round: long done, unless SLOTS copies are queued
        start = i * self.SLOT_BYTES
        slot = self.host[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
        slot[...] = array
        src = torch.from_numpy(slot)
        if out is None:
            out = src.to(self.device, non_blocking=True)
        else:
            out.copy_(src, non_blocking=True)
        if place == self.GROUP - 1:
            self.copied[group] = self.copied[group] or torch.cuda.Event()
            self.copied[group].record()
        return out


@functools.cache
def staging(device: torch.device) -> PinnedStaging:
    return PinnedStaging(device)
