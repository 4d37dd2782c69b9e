"""Triton's kernel launchers built side by side at a fresh start (issue 24).

Inductor compiles a graph's Triton kernels in its worker processes, then, in this process, waits for each kernel in
turn and builds its launcher (AsyncCompile._wait_futures). A kernel that torch's static launcher cannot start (every
kernel with a launch attribute: programmatic dependent launch, FLEXENGINE_PDL's default) gets Triton's own launcher, a
C module that the system's C compiler builds, one kernel after another. A fresh H200 start spent 11.3 s of its 88.8 s
waiting on those compiles (docs/benchmarks.md, session 48). Triton caches a launcher by its source, so a start that
finds the caches builds none.
"""
import functools
import logging
from concurrent.futures import Future, ThreadPoolExecutor

logger = logging.getLogger(__name__)

# C compiles at once (Inductor's worker processes compile the kernels meanwhile); 0: Inductor's own wait, one kernel
# after another (scripts/startup_time.py --serial-launchers, to compare the two on one box)
LAUNCHER_THREADS = 8


def parallel_wait_futures(wait_futures, pool: ThreadPoolExecutor):
    """AsyncCompile._wait_futures(self, scope) that first resolves every pending kernel of `scope` (a generated
    module's globals) on `pool`'s threads: waiting for its worker's compile and building its launcher (each
    CachingAutotuner.precompile holds the kernel's own lock and sets its device), then lets Inductor's own wait
    finish over a scope with nothing left pending."""
    from torch._inductor.codecache import CodeCacheFuture

    @functools.wraps(wait_futures)
    def wait_side_by_side(self, scope: dict) -> None:
        pending = {k: v for k, v in scope.items() if isinstance(v, (Future, CodeCacheFuture))}
        if len(pending) > 1:
            scope.update(zip(pending, pool.map(lambda future: future.result(), pending.values())))
        return wait_futures(self, scope)
    return wait_side_by_side


@functools.cache
def build_launchers_in_parallel() -> bool:
    """Install parallel_wait_futures into this process's Inductor, once. False, said once, where this torch's
    Inductor has no such wait (the launchers are then built one at a time, as before); False with LAUNCHER_THREADS 0."""
    if LAUNCHER_THREADS == 0:
        return False
    from torch._inductor.async_compile import AsyncCompile
    wait_futures = getattr(AsyncCompile, "_wait_futures", None)
    if wait_futures is None:
        logger.warning("this torch's Inductor has no AsyncCompile._wait_futures: Triton's kernel launchers are built "
                       "one at a time at start-up")
        return False
    pool = ThreadPoolExecutor(LAUNCHER_THREADS, thread_name_prefix="flexengine-launchers")
    AsyncCompile._wait_futures = parallel_wait_futures(wait_futures, pool)
    return True
