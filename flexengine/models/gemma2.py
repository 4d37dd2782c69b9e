"""Gemma 2: (1+w) RMSNorms before and after attention and MLP, sqrt(hidden)-scaled embeddings,
query_pre_attn_scalar ** -0.5 attention scale, tanh softcaps on attention scores and final logits,
and a sliding window on alternating layers (even layers, unless config.layer_types says otherwise).
"""
from __future__ import annotations

from .decoder import FULL, SLIDING, DecoderForCausalLM, base_spec, config_layer_types, rope_parameters


def gemma_common(config) -> dict:
    bias = bool(getattr(config, "attention_bias", False))
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention (embedding Gemma) is not supported")
    return dict(
        activation=getattr(config, "hidden_activation", None) or config.hidden_act,
        qkv_bias=bias, o_bias=bias, sandwich_norms=True, norm_unit_offset=True,
        embed_scale=config.hidden_size ** 0.5, attn_scale=config.query_pre_attn_scalar ** -0.5,
        final_softcap=getattr(config, "final_logit_softcapping", None),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
    )


def gemma2_spec(config):
    types = config_layer_types(config, lambda i: SLIDING if (i + 1) % 2 else FULL)
    rope = rope_parameters(config)
    return base_spec(config, layer_types=types, sliding_window=config.sliding_window,
                     rope={FULL: rope, SLIDING: rope},
                     attn_softcap=getattr(config, "attn_logit_softcapping", None), **gemma_common(config))


class Gemma2ForCausalLM(DecoderForCausalLM):
    def __init__(self, config):
        super().__init__(gemma2_spec(config))
