"""Qwen3: per-head RMSNorm on q and k before rotary, explicit head_dim, optional attention bias."""
from __future__ import annotations

from .decoder import DecoderForCausalLM, base_spec
from .qwen2 import qwen_window


def qwen3_spec(config):
    bias = bool(getattr(config, "attention_bias", False))
    return base_spec(config, qkv_bias=bias, o_bias=bias, qk_norm=True, **qwen_window(config))


class Qwen3ForCausalLM(DecoderForCausalLM):
    def __init__(self, config):
        super().__init__(qwen3_spec(config))
