"""Is a device → host copy with non_blocking=True asynchronous here? (Async scheduling relies on it.)

    python scripts/d2h_check.py
Queues about 50 ms of GPU work, then copies a small tensor to the host: an asynchronous copy returns
at once into pinned memory; a synchronous one waits for the queued work.
"""
import time

import torch

x = torch.randn(4096, 4096, device="cuda")
torch.cuda.synchronize()
for _ in range(3):
    start = time.perf_counter()
    for _ in range(20):
        x @ x  # about 2-3 ms each on an H100
    queued = time.perf_counter()
    y = x[0, :8].to("cpu", non_blocking=True)
    copied = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    print(f"queue {1e3 * (queued - start):.2f} ms, copy call {1e3 * (copied - queued):.2f} ms, "
          f"then sync {1e3 * (done - copied):.2f} ms; pinned: {y.is_pinned()}")
