"""Paged KV storage: per layer, K and V pages of shape [num_blocks, block_size, Hkv, D]."""
from __future__ import annotations

import torch


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                      head_dim: int, dtype: torch.dtype, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, a K and a V tensor [num_blocks, block_size, Hkv, D], each its own allocation.

    Not views of one tensor: a layer's compiled region writes the new K/V into them in place, fused with
    rotary, and Inductor may not write in place an input that shares its storage with another: a probe
    compiled with two such views as K and V copied the whole tensor around each write (132 ms a call on
    the CPU for 2 × 100k slots)."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # Never inference tensors, whoever asks: dynamo guards on a tensor's dispatch keys, and a layer region
    # compiled on the KV-sizing step's scratch cache (made under inference_mode) was compiled again for the real
    # one (twice, with and without the residual additions: ~3 s of a cold start on the H100, session 20).
    with torch.inference_mode(False):
        return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                for _ in range(num_layers)]


def kv_cache_bytes(cache: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for pair in cache for t in pair)


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the step's new K/V [T, Hkv, D] at flat slots (block * block_size + offset), vectorised.

    Indexed on the cache tensor itself, not on a flattened view of it: in a compiled region, torch 2.11's
    Inductor wrote through such a view by copying the whole cache (an OOM at capture on the H100, and
    a full copy per layer and step before that); indexed directly, the write stays in place."""
    P = key_cache.shape[1]
    page_offset = (slot_mapping // P, slot_mapping % P)
    key_cache.index_put_(page_offset, key.to(key_cache.dtype))
    value_cache.index_put_(page_offset, value.to(value_cache.dtype))
