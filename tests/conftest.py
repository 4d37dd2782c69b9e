import pytest
import torch

# Uninitialized memory (torch.empty and friends) reads as NaN in every test, so a result that
# depends on it fails here instead of passing by luck: a padding row nobody wrote once did. Torch
# fills it only in deterministic mode; warn_only keeps ops without a deterministic variant running.
torch.use_deterministic_algorithms(True, warn_only=True)
torch.utils.deterministic.fill_uninitialized_memory = True


@pytest.fixture(autouse=True)
def fresh_dynamo_for_gpu_tests(request):
    """Each GPU test starts with dynamo's caches empty: one process runs engines of many shapes, and
    their graphs would otherwise add up against a single recompile limit that no one engine reaches."""
    if request.node.get_closest_marker("gpu") is not None:
        torch._dynamo.reset()
    yield


@pytest.fixture
def gpu_shaped_engines(monkeypatch):
    """Engines built from here on take the CUDA engine's path on CPU (buckets, padding, warm-up, the
    decode-graph runner run eagerly), compiled by dynamo's `eager` backend, whose guards are the ones
    a GPU build has. Dynamo starts empty, so a test sees its own engine's compiles. Yields the undo."""
    from flexengine.attention.backends import flex, flex_kernels
    from flexengine.compile import reset_fused
    from flexengine.engine import model_runner

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, **{**kw, "backend": "eager"}))
    monkeypatch.setattr(model_runner, "wants_compile", lambda device, enforce_eager: not enforce_eager)
    monkeypatch.setattr(flex.FlexBackend, "compiled", lambda self, device: True)
    flex_kernels.clear_compiled()
    reset_fused()
    torch._dynamo.reset()

    def undo():
        monkeypatch.undo()
        flex_kernels.clear_compiled()
        reset_fused()

    yield undo
    undo()
