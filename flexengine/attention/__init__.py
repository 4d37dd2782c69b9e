"""Paged attention: the functional API, the metadata builder, the KV cache and the backends."""
from .paged_attention import paged_attention

__all__ = ["paged_attention"]
