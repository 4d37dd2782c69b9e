"""`no_device_syncs()`: fail on any op that makes the host wait for a CUDA device, seen on the CPU.

The engine launches a step's sampling inputs while the GPU runs the forward; one op that needs a device
value on the host (a boolean-mask index, `.item()`, `nonzero`) stalls the host until the forward is done,
and the work after it no longer overlaps. On CUDA `torch.cuda.set_sync_debug_mode` finds these; the CI
has no GPU, so this mode names the ops that sync there whatever the device they run on here.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# Ops whose result's size or value the host must read from the device.
SYNCING = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
           aten.is_nonzero.default, aten.equal.default, aten.repeat_interleave.Tensor,
           aten._unique2.default, aten.unique_consecutive.default, aten.unique_dim.default}
# Indexing ops that sync only with a boolean (mask) index: it is turned into positions first.
INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


class no_device_syncs(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNCING:
            raise AssertionError(f"{func} makes the host wait for the device")
        if func in INDEXING:
            masks = [i for i in args[1] if i is not None and i.dtype in (torch.bool, torch.uint8)]
            if masks:
                raise AssertionError(f"{func} with a boolean index makes the host wait for the device")
        return func(*args, **(kwargs or {}))
