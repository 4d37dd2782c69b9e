"""A mod sees GLOBAL head indices under tensor parallelism.

Rank r runs query heads [r * n, (r + 1) * n) of the model as its local heads 0..n-1, and the attention
backends hand a mod the local index. `shift_layer_mods` gives each layer of a rank with an offset the
mods wrapped so that `h` arrives shifted by it: a mod reading h (alibi slopes, a per-head mask) then
computes what it computes at TP=1. This is the only place the offset is applied; no backend knows it.

Mods that cannot read h are left as they are (the same objects, so the flash backend still recognises
causal, its windows and softcaps), and each mod is wrapped once for all its layers, so the metadata
builder still makes one BlockMask per distinct mask and step.
"""
from __future__ import annotations

from ..masks import MASK_ARGS, SCORE_ARGS, causal, mod_name, request_params


def reads_no_head(fn) -> bool:
    """The built-in mods FlashAttention can express (causal, windows, softcaps) ignore h."""
    return fn is causal or hasattr(fn, "flash_window") or hasattr(fn, "flash_softcap")


def with_head_offset(fn, offset: int, score: bool):
    """`fn` called with h + offset; its marks (causal_safe, kv_bounds, mod_name, per-request parameters)
    kept."""
    if fn is None or offset == 0 or reads_no_head(fn):
        return fn
    params = request_params(fn, SCORE_ARGS if score else MASK_ARGS)
    if score:
        def shifted(s, b, h, q_idx, kv_idx, *values):
            return fn(s, b, h + offset, q_idx, kv_idx, *values)
    else:
        def shifted(b, h, q_idx, kv_idx, *values):
            return fn(b, h + offset, q_idx, kv_idx, *values)
    shifted.__dict__.update(getattr(fn, "__dict__", {}))
    shifted.request_params = dict(params)
    shifted.mod_name = mod_name(fn)
    shifted.head_offset = offset
    return shifted


def shift_layer_mods(layers) -> None:
    """Wrap each layer's mods by the layer's head_offset (set by the model under tensor parallelism;
    absent or 0 leaves everything as it is)."""
    wrapped = {}
    for layer in layers:
        offset = getattr(layer, "head_offset", 0)
        for attr, score in (("mask_mod", False), ("score_mod", True)):
            fn = getattr(layer, attr)
            key = (id(fn), offset, score)
            if key not in wrapped:
                wrapped[key] = (fn, with_head_offset(fn, offset, score))  # fn kept alive: ids stay unique
            setattr(layer, attr, wrapped[key][1])
