"""Gemma 3 (text): Gemma 2's block plus (1+w) q/k norms, five local layers per global one by default,
and a separate rope for local layers (rope_local_base_freq, unscaled). transformers' Gemma 3 does not
apply attn_logit_softcapping, so neither do we.
"""
from __future__ import annotations

from .decoder import FULL, SLIDING, DecoderForCausalLM, base_spec, config_layer_types, rope_parameters
from .gemma2 import gemma_common


def gemma3_rope(config) -> dict:
    params = getattr(config, "rope_parameters", None)
    if params and FULL in params and SLIDING in params:  # transformers 5: one dict per layer type
        return {FULL: rope_parameters(config, FULL), SLIDING: rope_parameters(config, SLIDING)}
    return {FULL: rope_parameters(config),
            SLIDING: {"rope_type": "default", "rope_theta": getattr(config, "rope_local_base_freq", 10_000.0)}}


def gemma3_spec(config):
    pattern = getattr(config, "sliding_window_pattern", None) or getattr(config, "_sliding_window_pattern", 6)
    types = config_layer_types(config, lambda i: SLIDING if (i + 1) % pattern else FULL)
    return base_spec(config, layer_types=types, sliding_window=config.sliding_window, rope=gemma3_rope(config),
                     qk_norm=True, **gemma_common(config))


class Gemma3ForCausalLM(DecoderForCausalLM):
    def __init__(self, config):
        super().__init__(gemma3_spec(config))
