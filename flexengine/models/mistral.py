"""Mistral: Llama's decoder with a sliding window on every layer (sliding_window None → causal)."""
from __future__ import annotations

from .decoder import FULL, SLIDING, DecoderForCausalLM, base_spec, rope_parameters


def mistral_spec(config):
    window = getattr(config, "sliding_window", None)
    kind = SLIDING if window is not None else FULL
    return base_spec(config, layer_types=[kind] * config.num_hidden_layers, sliding_window=window,
                     rope={kind: rope_parameters(config)})


class MistralForCausalLM(DecoderForCausalLM):
    def __init__(self, config):
        super().__init__(mistral_spec(config))
