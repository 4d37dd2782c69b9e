"""FlashAttention fallback: the paged FlashAttention kernels for layers whose mask they can express.

Providers, in order of preference (the first one installed that accepts the page size serves):
  1. `flash_attn_interface`  FA3 (Hopper build): flash_attn_with_kvcache(page_table=..., cu_seqlens_q=...).
  2. `flash_attn`            FA2: flash_attn_varlen_func(block_table=...); paged KV needs block_size % 256 == 0.
  3. `flash_attn.cute`       FA4 (flash-attn-4): flash_attn_varlen_func(page_table=..., seqused_k=...), any page size.
A step where every request is a whole prompt with no cached prefix needs no paging: its K/V are the
step's own tokens, read back from the cache by slot, and torch's built-in flash kernel
(torch.nn.attention.varlen.varlen_attn, else SDPA per request) serves it.

A layer can use FlashAttention only if its mask is causal or a causal sliding window (`.flash_window`)
and its score mod is none or a softcap (`.flash_softcap`).
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from ...config import fa4_disk_cache_default
from ...masks import causal, mod_name
from ..metadata import AttentionMetadata
from ..staging import to_device

try:  # torch >= 2.9; older torch serves fresh prefills with SDPA per request
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None

logger = logging.getLogger(__name__)

# Head sizes FA2/FA3 build kernels for and FA4 takes on Hopper. Others (72, 80, ...) are padded up (FA2/FA3)
# or accepted on some GPU generations only (FA4), so flexengine keeps to these.
FLASH_HEAD_DIMS = (32, 64, 96, 128, 192, 256)
FLASH_DTYPES = (torch.float16, torch.bfloat16)
INSTALL_HINT = "pip install flash-attn-4 (flash_attn.cute), or flash-attn (FA2/FA3)"
_VARLEN_ARGS = inspect.signature(varlen_attn).parameters if varlen_attn is not None else {}
_NOTICED: set[str] = set()


class Unsupported(str):
    """Why flash cannot serve (or auto passes it over), with a kind: mask, score, dtype, provider,
    head_size, page_size, import, graphs."""

    def __new__(cls, kind: str, text: str):
        self = super().__new__(cls, text)
        self.kind = kind
        return self


# ---------------------------------------------------------------- providers: how each is called
def call_fa3(fn, q, kc, vc, step: FlashStep, window, softcap, scale):
    return fn(q, kc, vc, cache_seqlens=step.seqused_k, page_table=step.page_table, cu_seqlens_q=step.cu_seqlens_q,
              max_seqlen_q=step.max_q, softmax_scale=scale, causal=True, window_size=window, softcap=softcap)


def call_fa2(fn, q, kc, vc, step: FlashStep, window, softcap, scale):
    return fn(q, kc, vc, step.cu_seqlens_q, step.cu_seqlens_k, step.max_q, step.max_k, softmax_scale=scale,
              causal=True, window_size=window, softcap=softcap, block_table=step.page_table)


def call_fa4(fn, q, kc, vc, step: FlashStep, window, softcap, scale):
    # With a page_table FA4 takes K lengths as seqused_k (cu_seqlens_k must be None); returns (out, lse).
    return fn(q, kc, vc, cu_seqlens_q=step.cu_seqlens_q, seqused_k=step.seqused_k, max_seqlen_q=step.max_q,
              max_seqlen_k=step.max_k, page_table=step.page_table, softmax_scale=scale, causal=True,
              window_size=window, softcap=softcap)


@dataclass(frozen=True)
class Provider:
    module: str
    function: str
    label: str
    page_multiple: int           # block_size must be a multiple of this
    call: Callable


PROVIDERS = (
    Provider("flash_attn_interface", "flash_attn_with_kvcache", "FA3", 1, call_fa3),
    Provider("flash_attn", "flash_attn_varlen_func", "FA2", 256, call_fa2),
    Provider("flash_attn.cute", "flash_attn_varlen_func", "FA4", 1, call_fa4),
)


def provider_installed(provider: Provider) -> bool:
    """Found on the path, without importing it (for FA4, its parent package `flash_attn` is imported)."""
    if provider.module == "flash_attn":
        spec = importlib.util.find_spec("flash_attn")
        # flash-attn-4 alone leaves `flash_attn` a namespace package (no __init__.py, origin None): not FA2.
        return spec is not None and spec.origin is not None
    if provider.module == "flash_attn.cute":
        return (importlib.util.find_spec("flash_attn") is not None
                and importlib.util.find_spec("flash_attn.cute") is not None)
    return importlib.util.find_spec(provider.module) is not None


def import_failure(provider: Provider, error: ImportError) -> Unsupported:
    return Unsupported("import", f"{provider.module} ({provider.label}) is installed but failed to import: {error}")


def installed_providers() -> list[tuple[Provider, Unsupported | None]]:
    """(provider, its import failure or None), in order of preference."""
    found = []
    for p in PROVIDERS:
        try:
            if provider_installed(p):
                found.append((p, None))
        except ImportError as e:  # finding flash_attn.cute imports flash_attn (FA2's __init__ if present)
            found.append((p, import_failure(p, e)))
    return found


def serves_page_size(provider: Provider, block_size: int | None) -> bool:
    return block_size is None or block_size % provider.page_multiple == 0


def first_usable(block_size: int | None) -> tuple[Provider, Unsupported | None] | None:
    return next(((p, err) for p, err in installed_providers() if serves_page_size(p, block_size)), None)


def load_kernel(provider: Provider, error: Unsupported | None = None):
    """The provider's paged entry point, or an Unsupported reason if importing it fails."""
    if error is not None:
        return error
    fa4_disk_cache_default()
    try:
        module = importlib.import_module(provider.module)
    except ImportError as e:  # reported, never swallowed: auto notes it once, explicit flash raises it
        return import_failure(provider, e)
    return getattr(module, provider.function)


def find_flash_provider(block_size: int | None = None) -> str | None:
    """Module name of the first installed provider that accepts `block_size` (None: any), else None."""
    found = first_usable(block_size)
    return found[0].module if found else None


# ---------------------------------------------------------------- what flash can serve
def layer_unsupported_reason(mask_mod, score_mod) -> str | None:
    if mask_mod is not causal and getattr(mask_mod, "flash_window", None) is None:
        return Unsupported("mask", f"mask {mod_name(mask_mod)} is not causal or a sliding window")
    if score_mod is not None and getattr(score_mod, "flash_softcap", None) is None:
        return Unsupported("score", f"score mod {mod_name(score_mod)} is not a softcap")
    return None


def flash_unsupported_reason(mods, head_dim: int | None, block_size: int | None = None,
                             dtype: torch.dtype | None = None) -> str | None:
    """Why the flash backend cannot serve these layers, or None if it can (this imports the provider)."""
    for mask_mod, score_mod in mods:
        reason = layer_unsupported_reason(mask_mod, score_mod)
        if reason:
            return reason
    installed = installed_providers()
    if not installed:  # checked first: without a provider, flex is simply the default, not a fallback
        return Unsupported("provider", f"no FlashAttention provider is installed ({INSTALL_HINT})")
    if dtype is not None and dtype not in FLASH_DTYPES:
        return Unsupported("dtype", f"dtype {dtype} is not float16 or bfloat16")
    if head_dim is not None and head_dim not in FLASH_HEAD_DIMS:
        return Unsupported("head_size", f"head size {head_dim} is not one FlashAttention supports "
                                        f"({', '.join(map(str, FLASH_HEAD_DIMS))})")
    found = first_usable(block_size)
    if found is None:
        rules = "; ".join(f"{p.module} ({p.label}) paged KV needs block_size % {p.page_multiple} == 0"
                          for p, _ in installed)
        return Unsupported("page_size", f"block_size {block_size} does not fit: {rules}; install flash-attn-4 "
                                         f"(any page size) or use block_size 256")
    kernel = load_kernel(*found)
    return kernel if isinstance(kernel, Unsupported) else None


def note_auto_fallback(reason: str) -> None:
    """auto falls back to flex; say so once where a user with FlashAttention would expect it."""
    noticed_kinds = ("head_size", "page_size", "import", "dtype", "graphs")
    if getattr(reason, "kind", None) in noticed_kinds and reason not in _NOTICED:
        _NOTICED.add(reason)
        logger.warning("attention backend auto: using flex, not flash: %s", reason)


def make_flash_backend(block_size: int | None = None, torch_prefill: bool = True):
    found = first_usable(block_size)
    if found is None:
        raise ValueError(f"attention backend 'flash': no FlashAttention provider serves block_size {block_size} "
                         f"({INSTALL_HINT})")
    kernel = load_kernel(*found)
    if isinstance(kernel, Unsupported):
        raise ValueError(f"attention backend 'flash': {kernel}")
    return FlashBackend(found[0], kernel, torch_prefill)


# ---------------------------------------------------------------- the step
@dataclass
class FlashStep:
    """Per-step arguments shared by every layer: built once in prepare()."""
    cu_seqlens_q: torch.Tensor   # int32 [R + 1]
    cu_seqlens_k: torch.Tensor   # int32 [R + 1]; FA2 reads each request's K length from it
    seqused_k: torch.Tensor      # int32 [R]; context length of each request
    page_table: torch.Tensor     # int32 [R, M], contiguous
    max_q: int
    max_k: int
    query_lens: list[int]
    fresh_prefill: bool          # every request is a whole prompt with no cached prefix
    slots: torch.Tensor | None   # fresh prefill: the flat cache slot of each query token's own K/V


def build_step(meta: AttentionMetadata, num_tokens: int) -> FlashStep:
    ql, sl = meta.layout.query_lens, meta.layout.seq_lens
    device = meta.block_tables.device
    cu = np.zeros((2, len(ql) + 1), dtype=np.int32)
    np.cumsum(ql, out=cu[0, 1:])
    np.cumsum(sl, out=cu[1, 1:])
    packed = to_device(cu, device)  # one copy for both
    fresh = all(n == L for n, L in zip(ql, sl))
    return FlashStep(cu_seqlens_q=packed[0], cu_seqlens_k=packed[1], seqused_k=meta.seq_lens.to(torch.int32),
                     page_table=meta.block_tables.to(torch.int32).contiguous(), max_q=max(ql), max_k=max(sl),
                     query_lens=list(ql), fresh_prefill=fresh,
                     slots=fresh_prefill_slots(meta, num_tokens) if fresh else None)


def fresh_prefill_slots(meta: AttentionMetadata, num_tokens: int) -> torch.Tensor:
    """Where each query token's K/V sits: the engine's slot_mapping, else (functional API) from the block table."""
    if meta.slot_mapping.numel() == num_tokens:
        return meta.slot_mapping
    ql, P = meta.layout.query_lens, meta.block_size
    req = np.repeat(np.arange(len(ql)), ql)
    pos = np.concatenate([np.arange(n) for n in ql])
    idx = torch.from_numpy(np.stack([req, pos])).to(meta.block_tables.device)
    return meta.block_tables[idx[0], idx[1] // P].long() * P + idx[1] % P


def varlen_serves(query: torch.Tensor) -> bool:
    # torch 2.9's varlen_attn has neither scale nor window_size: SDPA serves there
    return query.is_cuda and "window_size" in _VARLEN_ARGS and "scale" in _VARLEN_ARGS


def torch_prefill_serves(query, mask_mod, score_mod) -> bool:
    """torch's kernels have no softcap; a window needs varlen_attn (SDPA's flash path takes no mask)."""
    return score_mod is None and (mask_mod is causal or varlen_serves(query))


def attend_fresh_prefill(query, key_cache, value_cache, step: FlashStep, window: int | None, scale: float):
    NB, P, Hkv, D = key_cache.shape
    Hq = query.shape[1]
    k = key_cache.view(NB * P, Hkv, D)[step.slots]
    v = value_cache.view(NB * P, Hkv, D)[step.slots]
    if varlen_serves(query):
        kw = {}
        if "enable_gqa" in _VARLEN_ARGS:
            kw["enable_gqa"] = Hq != Hkv
        elif Hq != Hkv:
            k, v = k.repeat_interleave(Hq // Hkv, dim=1), v.repeat_interleave(Hq // Hkv, dim=1)
        left = -1 if window is None else window - 1
        return varlen_attn(query, k, v, step.cu_seqlens_q, step.cu_seqlens_q, step.max_q, step.max_q,
                           scale=scale, window_size=(left, 0), **kw)
    out = torch.empty_like(query)
    start = 0
    for n in step.query_lens:  # causal only (torch_prefill_serves)
        sl = slice(start, start + n)
        o = F.scaled_dot_product_attention(query[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1),
                                           is_causal=True, scale=scale, enable_gqa=Hq != Hkv)
        out[sl] = o.transpose(0, 1)
        start += n
    return out


class FlashBackend:
    name = "flash"

    def __init__(self, provider: Provider, kernel: Callable, torch_prefill: bool = True):
        self.provider, self.kernel = provider, kernel
        self.torch_prefill = torch_prefill  # False: the paged kernel serves fresh prefills too

    def prepare(self, meta: AttentionMetadata, mods) -> None:
        for mask_mod, score_mod in mods:
            reason = layer_unsupported_reason(mask_mod, score_mod)
            if reason:
                raise ValueError(f"attention backend 'flash' cannot serve this layer: {reason}")
        if not serves_page_size(self.provider, meta.block_size):
            raise ValueError(f"attention backend 'flash': {self.provider.module} ({self.provider.label}) paged KV "
                             f"needs block_size % {self.provider.page_multiple} == 0, got {meta.block_size}")
        meta.backend_state["flash"] = build_step(meta, sum(meta.layout.query_lens))

    def forward(self, query, key_cache, value_cache, meta: AttentionMetadata, mask_mod, score_mod, scale):
        if query.dtype not in FLASH_DTYPES:
            raise ValueError(f"attention backend 'flash' needs float16 or bfloat16, got {query.dtype}; "
                             f"use a half-precision dtype or backend 'flex'")
        if "flash" not in meta.backend_state:
            self.prepare(meta, [(mask_mod, score_mod)])
        step = meta.backend_state["flash"]
        window = getattr(mask_mod, "flash_window", None)
        if self.torch_prefill and step.fresh_prefill and torch_prefill_serves(query, mask_mod, score_mod):
            return attend_fresh_prefill(query, key_cache, value_cache, step, window, scale)
        softcap = float(getattr(score_mod, "flash_softcap", 0.0))  # 0.0: off, in every provider
        # sliding_window(W) keeps W keys, q - (W-1) .. q; (-1, -1) with causal=True is plain causal
        window_size = (-1, -1) if window is None else (window - 1, 0)
        out = self.provider.call(self.kernel, query, key_cache, value_cache, step, window_size, softcap, scale)
        return out[0] if isinstance(out, tuple) else out  # FA4 returns (out, lse)
