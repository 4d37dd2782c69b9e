import pytest
import torch


@pytest.fixture(autouse=True)
def fresh_dynamo_for_gpu_tests(request):
    """Each GPU test starts with dynamo's caches empty: one process runs engines of many shapes, and
    their graphs would otherwise add up against a single recompile limit that no one engine reaches."""
    if request.node.get_closest_marker("gpu") is not None:
        torch._dynamo.reset()
    yield
