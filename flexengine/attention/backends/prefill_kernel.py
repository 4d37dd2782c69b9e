"""Which kernel serves the compiled flex prefill call over the workspace, and with which options.

FlexAttention compiles the paged mods either into its Triton template or, with
`kernel_options={"BACKEND": "FLASH"}` (torch >= 2.10 with flash-attn-4's CuTe DSL installed), into
FlashAttention-4, which iterates the same block-sparse lists. On the H100 FA4 ran a 2,048-token chunk
over a 32k prefix at 1.49x SDPA flash where the Triton template reached 1.08x (docs/benchmarks.md,
session 9), and it was faster than Triton in every prefill row of the attention table (session 10).
`FLEXENGINE_FLEX_PREFILL` chooses: triton, flash (an error where FA4 cannot serve), or auto, the
default: FA4 wherever it can serve (a CUDA device of compute capability 9 or 10, a head size it takes,
flash-attn-4 installed), else Triton, said once. Under flash and auto alike, a mod FA4's code generator
cannot compile falls back to Triton for good, with one warning naming why.
"""
from __future__ import annotations

import functools
import importlib.util
import logging

import torch

from ...config import env_flex_prefill_kernel, fa4_disk_cache_default

logger = logging.getLogger(__name__)

# kernel_options of the Triton prefill call; None: triton_options(head_dim). Benchmarks set it
# (scripts/flex_prefill_sweep.py); {"BACKEND": "FLASH"} there asks for FA4 as well.
PREFILL_KERNEL_OPTIONS: dict | None = None
FLASH_OPTIONS = {"BACKEND": "FLASH"}


def triton_options(head_dim: int) -> dict:
    """Two pipeline stages instead of the template's three at head size 64: on the H100 (torch 2.11) a
    2,048-token chunk over a 32k prefix went from 0.87x to 1.10x SDPA flash, a whole 16k prompt from
    0.81x to 1.08x; at 128 three stages stay best (0.98x against 0.89x). docs/benchmarks.md, session 9."""
    return {"num_stages": 2} if head_dim <= 64 else {}


@functools.cache
def fa4_installed() -> str | None:
    """None when flex can compile into FA4 here, else why not (checked once)."""
    fa4_disk_cache_default()
    try:
        from torch._inductor.kernel.flex.flex_flash_attention import ensure_flash_available
    except ImportError:
        return f"torch {torch.__version__} has no FlashAttention backend for flex (torch >= 2.10 has)"
    if importlib.util.find_spec("flash_attn") is None or not ensure_flash_available():
        return "flash-attn-4 (flash_attn.cute) is not installed"
    return None


def fa4_unsupported_reason(device: torch.device, dtype: torch.dtype, D: int) -> str | None:
    """Why FA4 cannot run prefill calls of head size D in `dtype` on `device`, or None."""
    if device.type != "cuda":
        return "FA4 needs a CUDA device"
    major, _ = torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        return f"FA4 runs on Hopper and Blackwell (compute capability 9.x, 10.x), not {major}.x"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"FA4 computes in float16/bfloat16, not {dtype}"
    if D % 8 or D > (256 if major == 9 else 128):
        return f"FA4 does not take head size {D} on compute capability {major}.x"
    return fa4_installed()


FAST_TANH = "cute.math.tanh({x}, fastmath=True)"  # FA4's own softcap's form


def lower_tanh_as(template: str) -> bool:
    """Make flex's FA4 code generator write `torch.tanh` in a mod as `template` (CuTe DSL code, `{x}` the operand),
    process-wide; False where this torch has no CuTe DSL tanh lowering to replace."""
    try:
        from torch._inductor.codegen.cutedsl.cutedsl_op_overrides import CuteDSLOpOverrides as ops
    except ImportError:
        return False
    if not callable(getattr(ops, "_apply_unary_op", None)) or not hasattr(ops, "tanh"):
        return False

    def tanh(x0):
        return ops._apply_unary_op(x0, template)
    ops.tanh = staticmethod(tanh)
    return True


@functools.cache
def use_fast_tanh() -> bool:
    """Make flex's FA4 code generator emit fast-math tanh (FAST_TANH) instead of the strict `math.tanh` torch
    lowers `torch.tanh` to. A softcap(30) mod with a 1,024 window cost 367 µs against 228 µs without it at 8 x 1024
    on the H100, 265 µs with fast tanh (docs/benchmarks.md, session 13). Process-wide, once; False (said once)
    where this torch has no such lowering to adjust: softcap stays correct, only slower."""
    if lower_tanh_as(FAST_TANH):
        return True
    logger.warning("flex prefill on FA4: torch %s has no CuTe DSL tanh lowering to switch to fast math; tanh "
                   "in a score mod stays the strict (slower) form", torch.__version__)
    return False


# Prefill tiles (Q_TILE rows) per q block of the FA4 call; None: fa4_q_tiles. Benchmarks set it
# (scripts/fa4_tile_probe.py measures the kernel alone).
FA4_Q_TILES: int | None = None


def fa4_q_tiles(device: torch.device, head_dim: int) -> int:
    """Prefill tiles of 128 rows that make one q block of the FA4 call. On Hopper at head size <= 64, FA4's
    forward takes 192-row tiles, its fastest there, only when the block mask's q block is a multiple of 192
    (flash_attn.cute.interface._tile_size_fwd_sm90), so three tiles (384 rows) make one block. H100, session 30
    (scripts/fa4_tile_probe.py): an 8,192-token causal chunk over 65,536 keys ran at 500 TFLOP/s in 128-row
    blocks and 544 in 384-row ones, over 16,384 keys 463 and 526. Elsewhere one tile."""
    if FA4_Q_TILES is not None:
        return FA4_Q_TILES
    return 3 if torch.cuda.get_device_capability(device)[0] == 9 and head_dim <= 64 else 1


class PrefillKernel:
    """The per-backend choice; `options(query)` gives the kernel_options of one prefill call."""

    def __init__(self):
        self.mode = env_flex_prefill_kernel()
        self.flash: bool | None = None  # decided at the first compiled prefill call (needs the device)

    def decide(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether FA4 serves the prefill calls (decided once, said once)."""
        if self.flash is None:
            reason = None if self.mode == "triton" else fa4_unsupported_reason(device, dtype, head_dim)
            if self.mode == "flash" and reason:
                raise ValueError(f"FLEXENGINE_FLEX_PREFILL=flash, but {reason}")
            self.flash = self.mode != "triton" and reason is None
            if self.mode == "auto" and device.type == "cuda":
                logger.info("flex prefill kernel: %s", "FlashAttention-4" if self.flash else
                            f"Triton ({reason}; FLEXENGINE_FLEX_PREFILL=triton|flash chooses)")
        return self.flash

    def q_tiles(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> int:
        """Prefill tiles per q block of the prefill BlockMask: fa4_q_tiles where FA4 serves, else one."""
        if PREFILL_KERNEL_OPTIONS is not None or not self.decide(device, dtype, head_dim):
            return 1
        return fa4_q_tiles(device, head_dim)

    def serves_flash(self) -> bool:
        """Whether the prefill calls go to FA4, as decided so far (undecided: no)."""
        if PREFILL_KERNEL_OPTIONS is not None:
            return "BACKEND" in PREFILL_KERNEL_OPTIONS
        return bool(self.flash)

    def options(self, query: torch.Tensor) -> dict:
        if PREFILL_KERNEL_OPTIONS is not None:
            return dict(PREFILL_KERNEL_OPTIONS)
        if self.decide(query.device, query.dtype, query.shape[-1]):
            use_fast_tanh()
            return dict(FLASH_OPTIONS)
        return triton_options(query.shape[-1]) if query.is_cuda else {}  # (Inductor's CPU template: its own)

    def refused(self, error: Exception) -> bool:
        """After a prefill call failed: True when it was FA4's (its code generator refusing a mod), and
        the Triton kernel serves from now on (said once); False when the failure must propagate."""
        if not self.flash or PREFILL_KERNEL_OPTIONS is not None:
            return False
        lines = [line.strip(" =") for line in str(error).splitlines() if line.strip(" =")]  # drop banners
        logger.warning("flex prefill: FlashAttention-4 cannot compile this model's mods (%s); the Triton kernel "
                       "serves from now on", " ".join(lines[:2])[:300] or type(error).__name__)
        self.flash = False
        return True
