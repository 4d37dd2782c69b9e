"""Qwen2 / 2.5: bias on q, k, v (not o); a sliding window on the layers the config marks."""
from __future__ import annotations

from .decoder import FULL, SLIDING, DecoderForCausalLM, base_spec, config_layer_types, rope_parameters


def qwen_window(config):
    """(layer types, window): transformers' rule is sliding from layer max_window_layers on, and only
    when use_sliding_window is set."""
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", False) else None
    first = getattr(config, "max_window_layers", config.num_hidden_layers)
    types = config_layer_types(config, lambda i: SLIDING if window is not None and i >= first else FULL)
    rope = rope_parameters(config)
    return dict(layer_types=types, sliding_window=window, rope={FULL: rope, SLIDING: rope})


def qwen2_spec(config):
    return base_spec(config, qkv_bias=True, **qwen_window(config))


class Qwen2ForCausalLM(DecoderForCausalLM):
    def __init__(self, config):
        super().__init__(qwen2_spec(config))
