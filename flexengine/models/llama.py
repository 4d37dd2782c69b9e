"""Llama 2 / 3 / 3.1 / 3.2: the plain decoder (llama3 rope scaling and tied heads come from the config)."""
from __future__ import annotations

from .decoder import DecoderForCausalLM, base_spec


def llama_spec(config, **overrides):
    bias = bool(getattr(config, "attention_bias", False))
    return base_spec(config, qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)),
                     **overrides)


class LlamaForCausalLM(DecoderForCausalLM):
    def __init__(self, config):
        super().__init__(llama_spec(config))
