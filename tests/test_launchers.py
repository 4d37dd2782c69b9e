"""compile/launchers.py: Inductor's wait for a generated module's kernels, resolving them side by side."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch._inductor.async_compile import AsyncCompile
from torch._inductor.codecache import LambdaFuture

from flexengine.compile.launchers import parallel_wait_futures


def test_pending_kernels_resolve_side_by_side_and_fill_the_scope():
    """Three kernels whose results each wait for the other two (a barrier of three): Inductor's own wait, one after
    another, would break the barrier; the parallel wait resolves them together, puts each result under its name,
    and leaves what is not pending as it was."""
    barrier = threading.Barrier(3, timeout=10)

    def kernel(name):
        def result():
            barrier.wait()
            return f"compiled {name}"
        return LambdaFuture(result)

    scope = {"triton_a": kernel("a"), "triton_b": kernel("b"), "triton_c": kernel("c"), "plain": 7}
    with ThreadPoolExecutor(4) as pool:
        parallel_wait_futures(AsyncCompile._wait_futures, pool)(AsyncCompile(), scope)
    assert scope == {"triton_a": "compiled a", "triton_b": "compiled b", "triton_c": "compiled c", "plain": 7}


def test_a_failed_kernel_fails_the_wait():
    def broken():
        raise RuntimeError("ptxas died")

    scope = {"ok": LambdaFuture(lambda: "fine"), "bad": LambdaFuture(broken)}
    with ThreadPoolExecutor(2) as pool, pytest.raises(RuntimeError, match="ptxas died"):
        parallel_wait_futures(AsyncCompile._wait_futures, pool)(AsyncCompile(), scope)


@pytest.mark.gpu
def test_compiled_kernels_with_pdl_on_empty_caches_equal_eager(tmp_path):
    """On CUDA, with empty Inductor and Triton caches (so every launcher is built) and PDL's launch attribute (no
    static launcher): a compiled region of several kernels through the engine's compile_region gives eager's result,
    and its wait is the parallel one."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    code = """
import torch
from flexengine.compile.policy import compile_region
from torch._inductor.async_compile import AsyncCompile

def region(x, w):
    y = torch.nn.functional.silu(x @ w) * x.sum(-1, keepdim=True)
    return torch.nn.functional.rms_norm(y, (y.shape[-1],)), y.amax(0)

x, w = torch.randn(33, 256, device="cuda"), torch.randn(256, 256, device="cuda")
got = compile_region(region, combo=False)(x, w)
want = region(x, w)
assert hasattr(AsyncCompile._wait_futures, "__wrapped__"), "Inductor's own wait"  # (functools.wraps: same name)
for g, e in zip(got, want):
    torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
print("ok")
"""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "TRITON_CACHE_DIR": str(tmp_path / "triton"), "FLEXENGINE_PDL": "on"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
