"""The attention layer models use: write the new K/V into the paged cache, then attend."""
from __future__ import annotations

import torch
from torch import nn

from ..masks import get_mask_mod, get_score_mod
from .kv_cache import write_kv
from .metadata import AttentionMetadata


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 mask_mod="causal", score_mod=None, kind: str = "global"):
        super().__init__()
        assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.kind = kind  # "global" or "sliding": what LLM(mask_mod={"sliding": ...}) overrides
        self.mask_mod = get_mask_mod(mask_mod)
        self.score_mod = get_score_mod(score_mod)
        self.k_cache: torch.Tensor | None = None  # [num_blocks, block_size, Hkv, D], attached by the runner
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] → [T, Hq, D]."""
        write_kv(self.k_cache, self.v_cache, k, v, meta.slot_mapping)
        return self.attend(q, meta)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D] → [T, Hq, D], over a cache that already holds the step's K/V (the decoder layers write
        them in their compiled region, with rotary)."""
        return meta.backend.forward(q, self.k_cache, self.v_cache, meta, self.mask_mod, self.score_mod, self.scale)
