"""Host µs of one small host->device copy, by how: the engine's copy_into (pinned ring), and its parts."""
import time
import numpy as np
import torch
from flexengine.attention.staging import copy_into, staging

dev = torch.device("cuda")
buf = torch.zeros(1 << 20, dtype=torch.long, device=dev)
a3, a4k = np.arange(3, dtype=np.int64), np.arange(4096, dtype=np.int64)
pinned = torch.empty(4096, dtype=torch.long, pin_memory=True)
ev = torch.cuda.Event()
def t(fn, n=2000):
    fn(); torch.cuda.synchronize()
    s = time.perf_counter()
    for _ in range(n):
        fn()
    e = time.perf_counter(); torch.cuda.synchronize()
    return (e - s) / n * 1e6
busy = torch.randn(4096, 4096, device=dev)
for load in ("idle", "busy"):
    def maybe_busy(fn):
        def g():
            if load == "busy":
                busy.mul_(1.0)
            fn()
        return g
    base = t(maybe_busy(lambda: None))
    rows = {
        "copy_into 3": lambda: copy_into(a3, buf, dev),
        "copy_into 4096": lambda: copy_into(a4k, buf, dev),
        "from_numpy": lambda: torch.from_numpy(a3),
        "pinned slot copy_ 3": lambda: pinned[:3].copy_(torch.from_numpy(a3)),
        "H2D copy_ 3 from pinned": lambda: buf[:3].copy_(pinned[:3], non_blocking=True),
        "event record": lambda: ev.record(),
        "event synchronize": lambda: ev.synchronize(),
        "torch.cuda.Event()": lambda: torch.cuda.Event(),
        "buf[:3].view((3,))": lambda: buf[:3].view((3,)),
    }
    for name, fn in rows.items():
        print(f"{load:5s} {name:28s} {t(maybe_busy(fn)) - base:7.1f} us")
