"""Gated MLP activations: act(gate) * up on a fused [.., 2 * I] gate_up projection."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..compile import fused

# transformers' ACT2FN names → the function that name means there.
ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,  # exact (erf) gelu, as transformers' "gelu"
}


@fused
def act_and_mul(x: torch.Tensor, name: str) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return ACTIVATIONS[name](gate) * up


def get_activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(sorted(ACTIVATIONS))}")
    return ACTIVATIONS[name]


class ActAndMul(nn.Module):
    """[.., 2 * I] → act(x[.., :I]) * x[.., I:]."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self.act = get_activation(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return act_and_mul(x, self.name)

    def extra_repr(self) -> str:
        return self.name
