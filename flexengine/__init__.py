"""flexengine: LLM inference with FlexAttention over a paged KV cache."""
import importlib

_EXPORTS = {"LLM": ".llm", "SamplingParams": ".sampling_params", "RequestOutput": ".outputs",
            "CompletionOutput": ".outputs", "Logprob": ".outputs",
            "StructuredOutputsParams": ".structured_outputs"}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    # Lazy, so `flexengine bench serve` (an HTTP client) and `--help` start without importing torch.
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module 'flexengine' has no attribute {name!r}")
