"""Rotary position embedding (neox / rotate-half layout) with default, linear and llama3 scaling.

cos/sin are computed from the positions each step (one outer product, no table to outgrow) in
float32, cast to the activations' dtype, then applied as transformers does.

`rotary_store`: a step of more than one row rotates q and k and stores k and v into the paged caches in one kernel
of its own (rotary_kernel.py) on CUDA, where Inductor made two of the layer region (q's rotary; k's with the cache
store): a launch fewer a layer (issue 16: batch 32 paid 32 such launches, 50 µs of its step, session 36's profile).
"""
from __future__ import annotations

import functools
import math

import torch
from torch import nn

from ..compile import fused
from .gemv import launches_with_pdl

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


# Whether a CUDA step's cos/sin come from cos_sin_kernel (rotary_kernel.py), which Triton compiles once per engine,
# instead of Inductor's kernel of fused_cos_sin, which dynamo compiles as two graphs (the batch-1 decode graph's and
# the rest's: 2.7-4.4 s of a fresh start, session 52's logs). Session 53, one H200 box (with PREFILL_SYMBOLIC_FIRST):
# no `fused_cos_sin` graph, and batch 1 0.979 / 0.981 ms a token against 0.980 / 0.995, batch 8 1.139 / 1.143 against
# 1.147 / 1.144.
COS_SIN_KERNEL = True


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] → (cos, sin) [T, 1, D/2] in `dtype`: one kernel a step on CUDA (not five launches: a decode
    step's every launch costs ~1 µs of gap)."""
    if COS_SIN_KERNEL and positions.is_cuda:
        return _launch_cos_sin(positions, inv_freq, dtype)
    return fused_cos_sin(positions, inv_freq, dtype)


@fused(autotune=False)
def fused_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) \
        -> tuple[torch.Tensor, torch.Tensor]:
    # One config: the first region a fresh start compiles, often before Inductor's workers are up, and its four
    # configs were compiled one after another in the main process (1.9-2.8 s, sessions 49-50)
    freqs = positions[:, None].float() * inv_freq[None, :]
    return freqs.cos().to(dtype)[:, None, :], freqs.sin().to(dtype)[:, None, :]


def _launch_cos_sin(positions, inv_freq, dtype):
    from triton import next_power_of_2 as pow2
    from .rotary_kernel import cos_sin_kernel
    T, half = positions.shape[0], inv_freq.shape[0]
    assert positions.is_contiguous() and inv_freq.is_contiguous() and inv_freq.dtype == torch.float32
    cos, sin = (positions.new_empty(T, 1, half, dtype=dtype) for _ in range(2))
    if T == 0:
        return cos, sin
    pdl = launches_with_pdl(positions.device)
    cos_sin_kernel[(T,)](positions, inv_freq, cos, sin, HALF=half, HALF_PAD=pow2(half), USE_PDL=pdl, num_warps=1,
                         **({"launch_pdl": True} if pdl else {}))
    return cos, sin


@fused
def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated as (x1, x2) → (x1 cos - x2 sin, x2 cos + x1 sin), in x's dtype."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


# q and k's rotary and the K/V store as one kernel in steps of more than one row on CUDA (rotary_store);
# False: Inductor's kernels in the layer region, as before session 37 (scripts/decode_step_probe.py rotary_store=0)
ROTARY_STORE = True


def stores_rotary(x: torch.Tensor) -> bool:
    """Whether a layer hands x's q/k/v projection to `rotary_store` (ROTARY_STORE, on CUDA; the one-row step folds
    rotary and the store into the projection's own kernel before this is asked)."""
    return ROTARY_STORE and x.is_cuda


@functools.cache
def _kernel():
    from .rotary_kernel import rotary_store_kernel  # imports triton: only once a kernel launches
    return rotary_store_kernel


def _launch(qkv, cos, sin, slot_mapping, k_cache, v_cache, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    from triton import next_power_of_2 as pow2
    T, half = qkv.shape[0], cos.shape[-1]
    D = 2 * half
    assert qkv.stride(1) == 1 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * D, (qkv.shape, num_heads, half)
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[-2:] == (num_kv_heads, D)
    cos, sin = cos.reshape(T, half), sin.reshape(T, half)
    assert cos.stride(1) == 1 and cos.stride() == sin.stride(), (cos.stride(), sin.stride())
    q = qkv.new_empty(T, num_heads, D)
    if T == 0:
        return q
    pdl = launches_with_pdl(qkv.device)
    # a decode step's few tokens: 8 heads a program, so that they spread over the SMs (a program a token took 1.9 µs
    # at 32 tokens on the H100, where Inductor's two kernels took 1.4 and 1.7); prompt chunks: a token's every head
    heads = num_heads + 2 * num_kv_heads
    block = pow2(heads) if T > 256 else min(8, pow2(heads))
    _kernel()[(T, -(-heads // block))](
        qkv, cos, sin, slot_mapping, q, k_cache, v_cache, qkv.stride(0), cos.stride(0), Q_HEADS=num_heads,
        KV_HEADS=num_kv_heads, HALF=half, HEADS_BLOCK=block, HALF_PAD=pow2(half), USE_PDL=pdl,
        num_warps=4 if block * half >= 1024 else 1, **({"launch_pdl": True} if pdl else {}))
    return q


@torch.library.custom_op("flexengine::rotary_store", mutates_args=("k_cache", "v_cache"))
def rotary_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """The q/k/v projection qkv [T, (Hq + 2 Hkv) D] → q [T, Hq, D] rotated (cos, sin [T, 1, D/2], neox layout); k
    rotated and v stored into the paged caches [pages, page size, Hkv, D] at the tokens' flat slots."""
    if qkv.is_cuda:
        return _launch(qkv, cos, sin, slot_mapping, k_cache, v_cache, num_heads, num_kv_heads)
    from ..attention.kv_cache import write_kv
    T, D = qkv.shape[0], 2 * cos.shape[-1]
    q, k, v = qkv.view(T, -1, D).split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    write_kv(k_cache, v_cache, apply_rotary.eager(k, cos, sin), v, slot_mapping)
    return apply_rotary.eager(q, cos, sin)


@rotary_store.register_fake
def _(qkv, cos, sin, slot_mapping, k_cache, v_cache, num_heads, num_kv_heads):
    return qkv.new_empty(qkv.shape[0], num_heads, 2 * cos.shape[-1])
