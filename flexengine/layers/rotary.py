"""Rotary position embedding (neox / rotate-half layout) with default, linear and llama3 scaling.

cos/sin are computed from the positions each step (one outer product, no table to outgrow) in
float32, cast to the activations' dtype, then applied as transformers does.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..compile import fused

ROPE_TYPES = ("default", "linear", "llama3")


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_position: int) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short kept, the band between interpolated."""
    low_freq_wavelen = original_max_position / low_freq_factor
    high_freq_wavelen = original_max_position / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def compute_inv_freq(head_dim: int, rope: dict) -> torch.Tensor:
    """`rope` is a transformers rope_parameters dict: rope_type, rope_theta and the type's fields."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    inv_freq = default_inv_freq(head_dim, float(rope["rope_theta"]))
    if rope_type == "linear":
        inv_freq = inv_freq / float(rope["factor"])
    elif rope_type == "llama3":
        inv_freq = llama3_inv_freq(inv_freq, float(rope["factor"]), float(rope["low_freq_factor"]),
                                   float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]))
    return inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rope: dict):
        super().__init__()
        self.head_dim, self.rope = head_dim, dict(rope)
        self.register_buffer("inv_freq", compute_inv_freq(head_dim, self.rope), persistent=False)

    def reset_buffers(self) -> None:
        """Recompute inv_freq in float32 (after the module was built on the meta device)."""
        device = self.inv_freq.device
        self.inv_freq = compute_inv_freq(self.head_dim, self.rope).to(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] → (cos, sin), each [T, 1, D/2] in `dtype`, broadcasting over heads."""
        return cos_sin(positions, self.inv_freq, dtype)


@fused
def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # one kernel a step on the CUDA engine, not five (a decode step's every launch costs ~1 µs of gap)
    freqs = positions[:, None].float() * inv_freq[None, :]
    return freqs.cos().to(dtype)[:, None, :], freqs.sin().to(dtype)[:, None, :]


@fused
def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated as (x1, x2) → (x1 cos - x2 sin, x2 cos + x1 sin), in x's dtype."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
