"""Built-in mask and score mods, in logical coordinates.

`b` is the request's index in the step, `h` the query head, `q_idx`/`kv_idx` token positions within
that request's sequence. Each mask may carry `kv_bounds(b, q_lo, q_hi, kv_len, *params)`: for a tile
of queries at positions q_lo..q_hi (inclusive) it returns half-open token ranges
`(any_lo, any_hi, all_lo, all_hi)` such that every kv the mask allows for some query of the tile lies
in [any_lo, any_hi) and every kv in [all_lo, all_hi) is allowed for all of them. The engine turns these
into page lists and full pages; a mask without bounds visits all of a request's pages (only those up to
the tile's last query if it is causal_safe), all of them as partial pages (`kv_bounds_of`).
A mask with `causal_safe = True` never lets a query see a later key, so a token's K/V depends only
on the tokens before it and its pages may be shared through the prefix cache.
"""
from __future__ import annotations

import torch

from .registry import MASK_ARGS, get_mask_mod, merge_request_params, mod_name, register_mask_mod, request_params


def _positive(name: str, value) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return value


def _zeros(x):
    return torch.zeros_like(x)


@register_mask_mod("causal")
def causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


causal.kv_bounds = lambda b, q_lo, q_hi, kv_len: (_zeros(q_lo), q_hi + 1, _zeros(q_lo), q_lo + 1)
causal.causal_safe = True  # never lets a query see a later key: its pages can go in the prefix cache


@register_mask_mod("bidirectional")
def bidirectional(b, h, q_idx, kv_idx):
    return (q_idx >= 0) & (kv_idx >= 0)  # always true, broadcast like the other masks


bidirectional.kv_bounds = lambda b, q_lo, q_hi, kv_len: (_zeros(q_lo), kv_len, _zeros(q_lo), kv_len)


def sliding_window(window: int):
    """0 <= q - kv < window: the token itself and window-1 before it (transformers' convention)."""
    window = int(_positive("sliding window", window))

    def sliding_window_mask(b, h, q_idx, kv_idx):
        d = q_idx - kv_idx
        return (d >= 0) & (d < window)

    sliding_window_mask.kv_bounds = lambda b, q_lo, q_hi, kv_len: (
        (q_lo - window + 1).clamp(min=0), q_hi + 1, (q_hi - window + 1).clamp(min=0), q_lo + 1)
    sliding_window_mask.mod_name = f"sliding_window({window})"
    sliding_window_mask.flash_window = window
    sliding_window_mask.causal_safe = True
    return sliding_window_mask


def chunked_local(chunk: int):
    """Causal within fixed chunks: kv <= q and q // chunk == kv // chunk."""
    chunk = int(_positive("chunk size", chunk))

    def chunked_local_mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx // chunk == kv_idx // chunk)

    chunked_local_mask.kv_bounds = lambda b, q_lo, q_hi, kv_len: (
        (q_lo // chunk) * chunk, q_hi + 1, (q_hi // chunk) * chunk, q_lo + 1)
    chunked_local_mask.mod_name = f"chunked_local({chunk})"
    chunked_local_mask.causal_safe = True
    return chunked_local_mask


def prefix_lm(prefix: int):
    """Bidirectional over the first `prefix` tokens, causal after: kv <= q or kv < prefix."""
    if isinstance(prefix, bool) or not isinstance(prefix, int) or prefix < 0:
        raise ValueError(f"prefix length must be a non-negative int, got {prefix!r}")

    def prefix_lm_mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx < prefix)

    prefix_lm_mask.kv_bounds = lambda b, q_lo, q_hi, kv_len: (
        _zeros(q_lo), torch.maximum(q_hi + 1, _zeros(q_hi) + prefix),
        _zeros(q_lo), torch.maximum(q_lo + 1, _zeros(q_lo) + prefix))
    prefix_lm_mask.mod_name = f"prefix_lm({prefix})"
    return prefix_lm_mask


@register_mask_mod("prefix_lm")
def prefix_lm_per_request(b, h, q_idx, kv_idx, prefix_len):
    """prefix_lm with the prefix length read per request (`attention_params={"prefix_len": P}`)."""
    return (kv_idx <= q_idx) | (kv_idx < prefix_len[b])


prefix_lm_per_request.kv_bounds = lambda b, q_lo, q_hi, kv_len, prefix_len: (
    _zeros(q_lo), torch.maximum(q_hi + 1, prefix_len[b]), _zeros(q_lo), torch.maximum(q_lo + 1, prefix_len[b]))


def softcap(cap: float):
    """cap * tanh(score / cap) (Gemma 2's attention logit softcapping)."""
    cap = float(_positive("softcap", cap))

    def softcap_score(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    softcap_score.mod_name = f"softcap({cap:g})"
    softcap_score.flash_softcap = cap
    return softcap_score


def alibi(slopes):
    """score + slopes[h] * (kv - q). The slope count must equal the query head count."""
    slopes = torch.as_tensor(slopes, dtype=torch.float32).flatten()
    if slopes.numel() == 0:
        raise ValueError("alibi needs at least one slope")

    on_device = {}  # filled eagerly by the first (checked) call, so compiled code never copies

    def alibi_score(score, b, h, q_idx, kv_idx):
        if score.device not in on_device:
            on_device[score.device] = slopes.to(score.device)
        return score + on_device[score.device][h] * (kv_idx - q_idx)

    alibi_score.num_heads = slopes.numel()
    alibi_score.mod_name = f"alibi({slopes.numel()} heads)"
    return alibi_score


def _combine(mods, op, bounds_op, name):
    assert mods, "composition needs at least one mask mod"
    merged = merge_request_params((m, MASK_ARGS) for m in mods)  # raises if two parts disagree on a dtype
    params = tuple(merged)
    own = [tuple(request_params(m, MASK_ARGS)) for m in mods]

    def pick(values, names):
        return [values[params.index(n)] for n in names]

    def combined(b, h, q_idx, kv_idx, *values):
        out = mods[0](b, h, q_idx, kv_idx, *pick(values, own[0]))
        for m, names in zip(mods[1:], own[1:]):
            out = op(out, m(b, h, q_idx, kv_idx, *pick(values, names)))
        return out

    combined.request_params = {n: p.dtype for n, p in merged.items()}
    combined.mod_name = f"{name}({', '.join(mod_name(m) for m in mods)})"
    if any(hasattr(m, "kv_bounds") for m in mods):  # a part without bounds adds what any mask allows
        def kv_bounds(b, q_lo, q_hi, kv_len, *values):
            parts = [kv_bounds_of(m)(b, q_lo, q_hi, kv_len, *pick(values, names)) for m, names in zip(mods, own)]
            return bounds_op(parts)
        combined.kv_bounds = kv_bounds
    return combined


def kv_bounds_of(mask):
    """The mask's `kv_bounds`, or for a mask without them what any such mask allows: keys up to the tile's
    last query if it is causal_safe, else the whole request, and no all-true range."""
    bounds = getattr(mask, "kv_bounds", None)
    if bounds is not None:
        return bounds
    causal_safe = _causal_safe(mask)

    def unknown(b, q_lo, q_hi, kv_len, *values):
        zero = torch.zeros_like(q_lo)
        return zero, (q_hi + 1 if causal_safe else kv_len + zero), zero, zero
    return unknown


def _and_bounds(parts):
    lo, hi, flo, fhi = parts[0]
    for a, b_, c, d in parts[1:]:
        lo, hi, flo, fhi = torch.maximum(lo, a), torch.minimum(hi, b_), torch.maximum(flo, c), torch.minimum(fhi, d)
    return lo, hi, flo, fhi


def _or_bounds(parts):
    # The union's hull covers every allowed kv; any one part's all-true range stays all-true.
    lo, hi, flo, fhi = parts[0]
    for a, b_, c, d in parts[1:]:
        wider = (d - c) > (fhi - flo)
        lo, hi = torch.minimum(lo, a), torch.maximum(hi, b_)
        flo, fhi = torch.where(wider, c, flo), torch.where(wider, d, fhi)
    return lo, hi, flo, fhi


def _causal_safe(mod) -> bool:
    return getattr(mod, "causal_safe", False)


def and_masks(*mods):
    """A mask allowing (q, kv) only where every mod allows it."""
    mods = [get_mask_mod(m) for m in mods]
    combined = _combine(mods, torch.logical_and, _and_bounds, "and")
    combined.causal_safe = any(_causal_safe(m) for m in mods)  # one causal-safe part bounds the whole
    return combined


def or_masks(*mods):
    """A mask allowing (q, kv) where any mod allows it."""
    mods = [get_mask_mod(m) for m in mods]
    combined = _combine(mods, torch.logical_or, _or_bounds, "or")
    combined.causal_safe = all(_causal_safe(m) for m in mods)
    return combined


