"""One-row projections for the batch-1 decode step, with the norm before them folded in (issue 16).

At batch 1 each projection is a GEMV that reads its weight once, and the small kernels between them (the
residual sum with its RMSNorm) cost their own run plus a launch gap each. Here a projection's Triton kernel
computes its input itself:

- `norm_gemv`: w @ rmsnorm(x [+ a] [+ b]) — the decoder's residual additions and norm in the prologue (each
  program recomputes the row's statistics from L2); the summed residual stream comes out too; for gate/up, SiLU
  and the gating product in the epilogue;
- `norm_gemv_rope`: norm_gemv for q/k/v with rotary and the K/V cache store as its epilogue (a program takes two
  rotary pairs (j, j + D/2) of one head), so the batch-1 layer's rotary kernel goes too (ROPE_EPILOGUE; H100,
  session 25: 1.239-1.241 ms/token against 1.259 without, same call);
- `gemv`: w @ x: the LM head, whose logits it can store as float32 for the sampler (the values rounded to the
  model's dtype, as before; one conversion launch fewer), and the bias-free o and down projections
  (parallel/layers.py's RowParallelLinear). It also takes a few rows [M <= FEW_ROWS, K] (`rows_kernel`, the rows
  padded to a power of two from 16 for the tensor cores) for every plain projection; FEW_ROWS is 0, so off: with one
  tile shape for every projection it lost to cuBLAS in the engine (H100, session 25: batch 8 at 1.954 ms a step
  against 1.580; session 25's per-width tiles, `rows_tiles`: batch 32 at 1.912 against 1.544). The LM head alone
  takes it up to HEAD_ROWS rows (32), where it wins;
- `gate_up_silu`: gate/up with SiLU's gating for any row count, on rows_kernel's gated form up to GATE_UP_ROWS rows
  (0, so off: it lost on the H100), else cuBLAS and one SiLU-and-mul kernel.

Under programmatic dependent launch (FLEXENGINE_PDL, on by default) the kernel reads its first weight tile before
waiting for the kernel before it (PREFETCH: no kernel writes the weights) and lets the next kernel launch before its
epilogue, so GEMV after GEMV overlaps; cuBLAS's kernels do neither. That is why o and down moved here: measured on
the H100 (scripts/one_row_parts.py; docs/benchmarks.md sessions 23-24), without PDL the down projection on this
GEMV was 0.077 ms a step slower than cuBLAS's split-K; with PDL and the prefetch, q/k/v, gate/up, o, down and the LM
head all here run batch 1 at 1.229-1.231 ms/token against 1.299-1.300 with o and down on cuBLAS (same call). Folding
SiLU's gating into the down projection's prologue lost (every program re-read the 8,192-wide gate/up row: +0.076
ms), so it is gate/up's epilogue. Each op is a torch custom op, so compiled regions and CUDA graphs hold it; off CUDA
(and where `one_row` says no) the model keeps its plain path, which the reference implementations below equal
(tests/test_gemv.py). `FLEXENGINE_ONE_ROW_GEMV=off` turns it off.
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from ..config import env_one_row_gemv, env_pdl

BLOCK_N, BLOCK_K, WARPS = 4, 1024, 4  # the probe's best at one row, for every projection of the 1B and 8B shapes
ENABLED = env_one_row_gemv()  # read once: compiled regions guard on this global, not on the environment
PDL = env_pdl()  # programmatic dependent launch (config.env_pdl), as Inductor's kernels get it
PREFETCH = 1  # weight tiles (0-2) read before PDL's wait for the kernel before (gemv_kernel; no gain without PDL)
# Up to this many rows (past one), the plain projections (q/k/v and gate/up unfolded, o, down, the LM head) take
# rows_kernel, which PDL overlaps as it does the one-row kernel; 0 (the default): cuBLAS, which it has not yet beaten
# (issue 16's batch 8 and 32; scripts/decode_step_probe.py few_rows=32)
FEW_ROWS = 0
# Up to this many rows (past one), the LM head alone takes rows_kernel, which writes the float32 logits the sampler
# reads (no conversion kernel after, as at one row); 0: cuBLAS and a float32 copy. The head is the one projection
# where the kernel beat cuBLAS at 8 and 32 rows (scripts/gemv_probe.py, session 25: 175.6-182.6 against 191.4-192.8
# µs at 32 rows of the 1B shape). H100, session 38 (scripts/decode_step_probe.py head_rows=32, one box): batch 32
# 1.520 / 1.521 ms a step against 1.543 / 1.542, batch 8 1.440 against 1.461. The logits are computed outside the
# compiled regions, so the row count is no guard there
HEAD_ROWS = 32
# Up to this many rows (past one), gate/up takes rows_kernel with SiLU's gating in its epilogue (`gate_up_silu`; no
# SiLU kernel after it), steps of more rows cuBLAS and one SiLU-and-mul kernel; 0: off, the region's own ops. The op
# takes every row count, so the compiled regions hold no comparison of it (no guard, no extra graph). Issue 16: at 32
# rows scripts/gemv_probe.py had the gated kernel at cuBLAS's speed (session 25: 25.5-26.2 against 26.3-27.0 µs),
# and batch 32 pays 16 SiLU launches (24 µs, session 37's profile); session 36 measured it with the LM head on the
# kernel too (+51 µs); alone (session 38, scripts/decode_step_probe.py gate_up_rows=32, same box) batch 32 ran 1.616
# ms a step against 1.548: off
GATE_UP_ROWS = 0
# q/k/v's one-row kernel with rotary and the K/V store as its epilogue (norm_gemv_rope) where a layer allows it
# (scripts/one_row_parts.py's "rope" part)
ROPE_EPILOGUE = True
ROWS_WARPS = 4


def rows_tiles(N: int) -> tuple[int, int]:
    """rows_kernel's (BLOCK_N, BLOCK_K) for an N-wide weight: the best of scripts/gemv_probe.py's configurations at 8
    and 32 rows of the 1B shapes on the H100 (session 25, call 1; 16 x 256 everywhere had the engine's batch 8 at
    1.954 ms a step against cuBLAS's 1.580): 64 x 128 from 16,384 outputs (gate/up, the LM head), 32 x 256 from
    3,072 (q/k/v), else 16 x 256 (o, down)."""
    return (64, 128) if N >= 16384 else (32, 256) if N >= 3072 else (16, 256)


def serves(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model on `device` in `dtype` takes the one-row kernels at all: a 16-bit float on CUDA."""
    return ENABLED and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)


def one_row(x: torch.Tensor) -> bool:
    """Whether the step's projections of x take the one-row kernels: one row that `serves` takes."""
    return x.shape[0] == 1 and serves(x.device, x.dtype)


def few_rows(x: torch.Tensor) -> bool:
    """Whether a plain projection of x takes `gemv` with more than one row: up to FEW_ROWS rows that `serves` takes
    (FEW_ROWS first: while it is 0, no comparison of a dynamic row count, so no guard in a compiled region)."""
    return FEW_ROWS > 1 and 1 < x.shape[0] <= FEW_ROWS and serves(x.device, x.dtype)


def head_rows(x: torch.Tensor) -> bool:
    """Whether the LM head of x's rows takes `gemv`: one row or a few (FEW_ROWS, or HEAD_ROWS for the head alone)."""
    return one_row(x) or few_rows(x) or (1 < x.shape[0] <= HEAD_ROWS and serves(x.device, x.dtype))


def takes_gate_up_silu(x: torch.Tensor) -> bool:
    """Whether an MLP hands x's gate/up and SiLU-and-mul to `gate_up_silu` (GATE_UP_ROWS, on a device `serves`)."""
    return GATE_UP_ROWS > 1 and serves(x.device, x.dtype)


@functools.cache
def _kernel():
    from .gemv_kernel import gemv_kernel  # imports triton: only once a kernel launches
    return gemv_kernel


@functools.cache
def _rows_kernel():
    from .gemv_kernel import rows_kernel
    return rows_kernel


@functools.cache
def _silu_and_mul_kernel():
    from .gemv_kernel import silu_and_mul_kernel
    return silu_and_mul_kernel


@functools.cache
def _pdl_capable(device: torch.device) -> bool:
    """A CUDA device of Hopper or later (griddepcontrol is sm90 PTX), not Triton's interpreter (no such launch)."""
    return (device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
            and torch.cuda.get_device_capability(device)[0] >= 9)


def launches_with_pdl(device: torch.device) -> bool:
    """Whether the engine's Triton kernels on `device` launch with programmatic dependent launch (FLEXENGINE_PDL and
    a device that has it): the GEMVs here and parallel/one_shot.py's sum."""
    return PDL and _pdl_capable(device)


def _launch(x, a, b, nw, w, prologue: int, eps: float = 0.0, write_sum: bool = False, gated: bool = False,
            out_dtype: torch.dtype | None = None, rope: tuple | None = None):
    """`rope`: (cos [D/2], sin [D/2], slot [1], k_cache, v_cache, query heads, KV heads): w is q/k/v's, and the
    kernel rotates q and k, stores k and v at the slot, and returns q alone (norm_gemv_rope)."""
    N, K = w.shape
    pdl = launches_with_pdl(x.device)
    N = N // 2 if gated else N
    assert x.shape[0] == 1 and x.is_contiguous() and w.is_contiguous(), (x.shape, w.shape)
    dummy = x  # never read: HAS_A / HAS_B / the prologue / ROPE say which pointers are
    cos, sin, slot, k_cache, v_cache, q_heads, kv_heads = rope or (dummy, dummy, dummy, dummy, dummy, 0, 0)
    half = cos.numel() if rope else 0
    if rope:
        assert BLOCK_N == 4 and half % 2 == 0 and N == (q_heads + 2 * kv_heads) * 2 * half, (N, q_heads, kv_heads, half)
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[-2:] == (kv_heads, 2 * half)
    out = x.new_empty(1, q_heads * 2 * half if rope else N, dtype=out_dtype or x.dtype)
    total = x.new_empty(1, K) if write_sum else out
    _kernel()[(-(-N // BLOCK_N),)](
        x, a if a is not None else dummy, b if b is not None else dummy, nw if nw is not None else dummy, w, out,
        total, N, K, eps, cos, sin, slot, k_cache, v_cache, PROLOGUE=prologue, HAS_A=a is not None,
        HAS_B=b is not None, WRITE_SUM=write_sum, GATED=gated, USE_PDL=pdl, PREFETCH=PREFETCH, BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K, ROPE=rope is not None, Q_HEADS=q_heads, KV_HEADS=kv_heads, HALF=half, num_warps=WARPS,
        **({"launch_pdl": True} if pdl else {}))
    return out, total


def _launch_rows(x, w, out_dtype: torch.dtype | None = None, gated: bool = False):
    (M, K), N = x.shape, w.shape[0]
    assert 1 < M <= 64 and x.is_contiguous() and w.is_contiguous(), (x.shape, w.shape)
    pdl = launches_with_pdl(x.device)
    block_n, block_k = rows_tiles(N)
    if gated:  # half the outputs, each from two weight rows: a program reads as many bytes as ungated
        N, block_n = N // 2, block_n // 2
    out = x.new_empty(M, N, dtype=out_dtype or x.dtype)
    _rows_kernel()[(-(-N // block_n),)](
        x, w, out, M, N, K, USE_PDL=pdl, PREFETCH=min(PREFETCH, 1), M_PAD=max(16, 1 << (M - 1).bit_length()),
        BLOCK_N=block_n, BLOCK_K=block_k, GATED=gated, num_warps=ROWS_WARPS, **({"launch_pdl": True} if pdl else {}))
    return out


def _silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    T, N = x.shape[0], x.shape[1] // 2
    assert x.is_contiguous(), x.stride()
    out = x.new_empty(T, N)
    if T:
        _silu_and_mul_kernel()[(T, -(-N // 1024))](x, out, N, BLOCK=1024, num_warps=4)
    return out


def _reference_sum(x, a, b):
    h = x.to(torch.float32, copy=True)  # a new tensor even when x is float32: an op's output may not alias its input
    for t in (a, b):
        if t is not None:
            h = h + t.float()
    return h.to(x.dtype)


def _reference_norm(h, nw, eps):
    hf = h.float()
    return nw * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)


@torch.library.custom_op("flexengine::norm_gemv", mutates_args=())
def norm_gemv(x: torch.Tensor, a: torch.Tensor | None, b: torch.Tensor | None, norm_weight: torch.Tensor,
              weight: torch.Tensor, eps: float, gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight @ rmsnorm(x + a + b), x + a + b) for one row x [1, K]; a, b optional, added in float32 and the sum
    rounded once to x's dtype, as the compiled regions' norm kernel does. `gated`: weight is [gate; up] and the
    projection comes out as silu(gate) * up (the MLP's SiLU-and-mul)."""
    if x.is_cuda:
        return _launch(x.contiguous(), a, b, norm_weight, weight, 1, eps, write_sum=True, gated=gated)
    h = _reference_sum(x, a, b)
    out = F.linear(_reference_norm(h, norm_weight, eps), weight)
    if gated:
        g, u = out.float().chunk(2, dim=-1)
        out = (F.silu(g) * u).to(x.dtype)
    return out, h


@norm_gemv.register_fake
def _(x, a, b, norm_weight, weight, eps, gated=False):
    return x.new_empty(1, weight.shape[0] // 2 if gated else weight.shape[0]), x.new_empty(1, x.shape[1])


@torch.library.custom_op("flexengine::norm_gemv_rope", mutates_args=("k_cache", "v_cache"))
def norm_gemv_rope(x: torch.Tensor, a: torch.Tensor | None, b: torch.Tensor | None, norm_weight: torch.Tensor,
                   weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                   num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """norm_gemv for q/k/v with what follows it in the layer folded in as well: rotary on q and k (cos, sin: the
    step's [1, 1, D/2], neox layout) and k and v stored into the paged caches [pages, page size, KV heads, D] at the
    token's slot. → (q [1, num_heads * D] rotated, x + a + b)."""
    if x.is_cuda:
        rope = (cos.reshape(-1), sin.reshape(-1), slot_mapping, k_cache, v_cache, num_heads, num_kv_heads)
        return _launch(x.contiguous(), a, b, norm_weight, weight, 1, eps, write_sum=True, rope=rope)
    from ..attention.kv_cache import write_kv
    from .rotary import apply_rotary
    qkv, h = norm_gemv(x, a, b, norm_weight, weight, eps)
    D = 2 * cos.shape[-1]
    q, k, v = qkv.view(1, -1, D).split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    q, k = apply_rotary.eager(q, cos, sin), apply_rotary.eager(k, cos, sin)
    write_kv(k_cache, v_cache, k, v, slot_mapping)
    return q.reshape(1, -1).clone(), h


@norm_gemv_rope.register_fake
def _(x, a, b, norm_weight, weight, eps, cos, sin, slot_mapping, k_cache, v_cache, num_heads, num_kv_heads):
    return x.new_empty(1, num_heads * 2 * cos.shape[-1]), x.new_empty(1, x.shape[1])


@torch.library.custom_op("flexengine::gemv", mutates_args=())
def gemv(x: torch.Tensor, weight: torch.Tensor, float32: bool = False) -> torch.Tensor:
    """weight @ x for one row x [1, K], or a few [M, K] (FEW_ROWS); `float32`: the result rounded to x's dtype as
    ever, but stored as float32 (the logits the sampler reads: no conversion kernel after)."""
    if x.is_cuda:
        out_dtype = torch.float32 if float32 else None
        if x.shape[0] > 1:
            return _launch_rows(x.contiguous(), weight, out_dtype)
        return _launch(x.contiguous(), None, None, None, weight, 0, out_dtype=out_dtype)[0]
    return _reference_gemv(x, weight, float32)


def _reference_gemv(x, weight, float32):
    out = F.linear(x, weight)
    return out.float() if float32 else out


@gemv.register_fake
def _(x, weight, float32=False):
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32 if float32 else x.dtype)


@torch.library.custom_op("flexengine::gate_up_silu", mutates_args=())
def gate_up_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) for x [T, K], weight [gate; up] (GATE_UP_ROWS): up to GATE_UP_ROWS rows (past
    one) one rows_kernel launch with the gating in its epilogue, more rows cuBLAS and one SiLU-and-mul kernel; the
    projection rounded to x's dtype as cuBLAS's output is, the product rounded once, as Inductor's kernel."""
    if x.is_cuda:
        if 1 < x.shape[0] <= GATE_UP_ROWS:
            return _launch_rows(x.contiguous(), weight, gated=True)
        return _silu_and_mul(F.linear(x, weight))
    return _reference_gate_up_silu(x, weight)


def _reference_gate_up_silu(x, weight):
    g, u = F.linear(x, weight).float().chunk(2, dim=-1)
    return (F.silu(g) * u).to(x.dtype)


@gate_up_silu.register_fake
def _(x, weight):
    return x.new_empty(x.shape[0], weight.shape[0] // 2)
