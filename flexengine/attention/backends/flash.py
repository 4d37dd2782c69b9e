"""FlashAttention fallback: provider detection and the reasons a model cannot use it.

Providers, in order of preference: `flash_attn` (FA2/FA3 paged API), `flash_attn.cute` (FA4).
A layer can use FlashAttention only if its mask is causal or a causal sliding window and its score
mod is none or softcap.
"""
from __future__ import annotations

import importlib.util

from ...masks import causal, mod_name

FLASH_HEAD_DIMS = (32, 64, 96, 128, 192, 256)


def find_flash_provider() -> str | None:
    for module in ("flash_attn", "flash_attn.cute"):
        try:
            if importlib.util.find_spec(module) is not None:
                return module
        except (ImportError, ValueError):
            continue
    return None


def layer_unsupported_reason(mask_mod, score_mod) -> str | None:
    if mask_mod is not causal and getattr(mask_mod, "flash_window", None) is None:
        return f"mask {mod_name(mask_mod)} is not causal or a sliding window"
    if score_mod is not None and getattr(score_mod, "flash_softcap", None) is None:
        return f"score mod {mod_name(score_mod)} is not a softcap"
    return None


def flash_unsupported_reason(mods, head_dim: int | None) -> str | None:
    """Why the flash backend cannot serve these layers, or None if it can."""
    for mask_mod, score_mod in mods:
        reason = layer_unsupported_reason(mask_mod, score_mod)
        if reason:
            return reason
    if head_dim is not None and head_dim not in FLASH_HEAD_DIMS:
        return f"head size {head_dim} is not one FlashAttention supports ({', '.join(map(str, FLASH_HEAD_DIMS))})"
    if find_flash_provider() is None:
        return "no FlashAttention provider is installed (pip install flash-attn, or flash-attn-4 for flash_attn.cute)"
    return None


def make_flash_backend():
    raise ValueError("attention backend 'flash': a provider was found, but flexengine's flash backend "
                     "is not implemented yet; use 'flex'")
