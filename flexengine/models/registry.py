"""Architecture name (config.json "architectures") → model class."""
from __future__ import annotations

from .gemma2 import Gemma2ForCausalLM
from .gemma3 import Gemma3ForCausalLM
from .llama import LlamaForCausalLM
from .mistral import MistralForCausalLM
from .qwen2 import Qwen2ForCausalLM
from .qwen3 import Qwen3ForCausalLM

MODELS = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}
# For configs without "architectures": model_type → architecture.
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}


def supported_architectures() -> list[str]:
    return sorted(MODELS)


def architecture_of(config) -> str:
    archs = list(getattr(config, "architectures", None) or [])
    if not archs and getattr(config, "model_type", None) in MODEL_TYPES:
        archs = [MODEL_TYPES[config.model_type]]
    for arch in archs:
        if arch in MODELS:
            return arch
    shown = ", ".join(archs) if archs else f"none (model_type {getattr(config, 'model_type', None)!r})"
    raise ValueError(f"unsupported model architecture: {shown}; supported: {', '.join(supported_architectures())}")


def get_model_class(config_or_architecture):
    """A transformers config (or an architecture name) → the flexengine class that runs it."""
    if isinstance(config_or_architecture, str):
        if config_or_architecture not in MODELS:
            raise ValueError(f"unsupported model architecture: {config_or_architecture}; "
                             f"supported: {', '.join(supported_architectures())}")
        return MODELS[config_or_architecture]
    return MODELS[architecture_of(config_or_architecture)]
