"""The layers' attention mods: LLM(mask_mod=..., score_mod=...) overrides and the per-request
parameters those mods read."""
from __future__ import annotations

from collections.abc import Mapping

from ..masks import (MASK_ARGS, SCORE_ARGS, RequestParam, check_mask_mod, check_score_mod, get_mask_mod, get_score_mod,
                     merge_request_params, mod_name)


def mod_params(mods) -> dict[str, RequestParam]:
    """{per-request parameter: its dtype and the mod that reads it} over the layers' (mask, score) pairs:
    one dtype per name for the whole engine, so every step shares one compiled kernel."""
    return merge_request_params((fn, base) for mask, score in mods
                                for fn, base in ((mask, MASK_ARGS), (score, SCORE_ARGS)) if fn is not None)


def query_heads(layer) -> int:
    """The heads a layer's mods index: the model's, also where a tensor-parallel rank runs only its share
    (the mods see global head indices, parallel/heads.py)."""
    return getattr(layer, "total_heads", layer.num_heads)


def override_targets(layers, spec, what: str) -> dict[int, object]:
    """{layer index: mod} for an override: one mod for every layer, or a mapping keyed by layer index
    or layer kind ("global" / "sliding"); an index key wins over its layer's kind key."""
    if spec is None:
        return {}
    if not isinstance(spec, Mapping):
        return {i: spec for i in range(len(layers))}
    kinds = sorted({a.kind for a in layers})
    targets, by_index = {}, {}
    for key, mod in spec.items():
        if isinstance(key, str):
            if key not in kinds:
                raise ValueError(f"{what} key {key!r} is not a layer kind of this model (its kinds: "
                                 f"{', '.join(map(repr, kinds))})")
            targets.update({i: mod for i, a in enumerate(layers) if a.kind == key})
        elif isinstance(key, int) and not isinstance(key, bool):
            if not 0 <= key < len(layers):
                raise ValueError(f"{what} key {key} is not a layer index: the model has layers 0..{len(layers) - 1}")
            by_index[key] = mod
        else:
            raise ValueError(f"{what} keys must be layer indices or kinds ('global', 'sliding'), got {key!r}")
    return {**targets, **by_index}


def apply_mod_overrides(layers, mask_spec, score_spec, *, max_len: int, num_reqs: int, device="cpu") -> None:
    """Set the overridden layers' mods, each checked once here so a broken mod fails at LLM(...), on the
    coordinates the engine will give it: the layer's query heads, positions up to max_len - 1, and
    per-request parameters as [num_reqs] tensors.

    A name or a callable resolves to ONE object for all its layers, so the metadata builder still makes
    one BlockMask per distinct mask and step.
    """
    masks = override_targets(layers, mask_spec, "mask_mod")
    for i, mod in masks.items():
        layers[i].mask_mod = get_mask_mod(mod)
    sizes = dict(max_len=max_len, num_reqs=num_reqs)
    for fn, heads in {(layers[i].mask_mod, query_heads(layers[i])) for i in masks}:
        check_mask_mod(fn, None, device, num_heads=heads, **sizes)
    scores = {i: get_score_mod(mod) for i, mod in override_targets(layers, score_spec, "score_mod").items()}
    for i, fn in scores.items():  # None in a mapping removes the layer's score mod
        heads = getattr(fn, "num_heads", None)
        if heads is not None and heads != query_heads(layers[i]):
            raise ValueError(f"score_mod {mod_name(fn)} has {heads} slopes but layer {i} has "
                             f"{query_heads(layers[i])} query heads")
        layers[i].score_mod = fn
    for fn, heads in {(fn, query_heads(layers[i])) for i, fn in scores.items() if fn is not None}:
        check_score_mod(fn, None, device, num_heads=heads, **sizes)
