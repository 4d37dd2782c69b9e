"""Logical attention mods and their registry: the user's extension point.

A mask mod is `mask_mod(b, h, q_idx, kv_idx) -> bool tensor`, a score mod is
`score_mod(score, b, h, q_idx, kv_idx) -> score`, all in logical coordinates (positions within the
request's own sequence). The engine translates them to the paged cache; this package imports nothing
from the engine.
"""
from .builtins import (alibi, and_masks, bidirectional, causal, chunked_local, kv_bounds_of, or_masks, prefix_lm,
                       prefix_lm_per_request, sliding_window, softcap)
from .checks import check_mask_mod, check_score_mod, vmap_over_coords
from .registry import (MASK_ARGS, SCORE_ARGS, RequestParam, get_mask_mod, get_score_mod, list_mask_mods,
                       list_score_mods, merge_request_params, mod_name, register_mask_mod, register_score_mod,
                       request_params)

__all__ = [
    "causal", "bidirectional", "sliding_window", "chunked_local", "prefix_lm", "prefix_lm_per_request",
    "softcap", "alibi", "and_masks", "or_masks", "kv_bounds_of", "register_mask_mod", "register_score_mod",
    "MASK_ARGS", "SCORE_ARGS", "get_mask_mod", "get_score_mod", "list_mask_mods", "list_score_mods", "mod_name", "request_params",
    "RequestParam", "merge_request_params", "check_mask_mod", "check_score_mod", "vmap_over_coords",
]
