"""Paged KV storage: per layer, K and V pages of shape [num_blocks, block_size, Hkv, D]."""
from __future__ import annotations

import torch


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                      head_dim: int, dtype: torch.dtype, device) -> torch.Tensor:
    """One tensor [num_layers, 2, num_blocks, block_size, Hkv, D]; layer l's K is cache[l, 0]."""
    return torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the step's new K/V [T, Hkv, D] at flat slots (block * block_size + offset), vectorised."""
    NB, P, H, D = key_cache.shape
    key_cache.view(NB * P, H, D).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(NB * P, H, D).index_copy_(0, slot_mapping, value.to(value_cache.dtype))
