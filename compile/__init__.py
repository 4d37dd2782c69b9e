"""torch.compile policy, warm-up and CUDA-graph capture for the model runner."""
from .policy import RECOMPILE_LIMIT, compile_count, configure_dynamo

__all__ = ["RECOMPILE_LIMIT", "compile_count", "configure_dynamo"]
