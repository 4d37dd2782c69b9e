"""RMSNorm, in the two rounding orders checkpoints were trained with."""
from __future__ import annotations

import torch
from torch import nn

from ..compile import fused


@fused
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


class RMSNorm(nn.Module):
    """x / rms(x) * w over the last dim, statistics in float32.

    unit_offset=False (Llama, Qwen, Mistral): normalise in fp32, cast back, then multiply by w.
    unit_offset=True (Gemma): the stored weight is w - 1; multiply by (1 + w) in fp32, then cast.
    The two orders round differently in bf16, so each family gets the one it was trained with.
    """

    def __init__(self, dim: int, eps: float = 1e-6, unit_offset: bool = False):
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.unit_offset)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, unit_offset={self.unit_offset}"
