"""Name → mod registries, so a mask can be chosen by a string anywhere one is accepted."""
from __future__ import annotations

import inspect
import types
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

_MASK_MODS: dict[str, Callable] = {}
_SCORE_MODS: dict[str, Callable] = {}

# The four coordinates every mod receives; any further parameters are per-request values.
MASK_ARGS = ("b", "h", "q_idx", "kv_idx")
SCORE_ARGS = ("score", "b", "h", "q_idx", "kv_idx")


def _register(table: dict, kind: str, name: str, replace: bool):
    if not isinstance(name, str) or not name:
        raise ValueError(f"{kind} name must be a non-empty string, got {name!r}")

    def decorator(fn: Callable) -> Callable:
        if not callable(fn):
            raise ValueError(f"{kind} {name!r} must be callable, got {type(fn).__name__}")
        if name in table and not replace:
            raise ValueError(f"{kind} {name!r} is already registered; pass replace=True to override it")
        table[name] = fn
        if getattr(fn, "mod_name", None) is None:
            fn.mod_name = name
        return fn

    return decorator


def register_mask_mod(name: str, *, replace: bool = False):
    """Decorator: make `mask_mod(b, h, q_idx, kv_idx) -> bool` selectable by `name`."""
    return _register(_MASK_MODS, "mask_mod", name, replace)


def register_score_mod(name: str, *, replace: bool = False):
    """Decorator: make `score_mod(score, b, h, q_idx, kv_idx) -> score` selectable by `name`."""
    return _register(_SCORE_MODS, "score_mod", name, replace)


def list_mask_mods() -> list[str]:
    return sorted(_MASK_MODS)


def list_score_mods() -> list[str]:
    return sorted(_SCORE_MODS)


def _lookup(table: dict, kind: str, mod):
    if callable(mod):
        return mod
    if isinstance(mod, str):
        if mod not in table:
            raise ValueError(f"unknown {kind} {mod!r}; registered: {', '.join(sorted(table))}")
        return table[mod]
    raise ValueError(f"{kind} must be a registered name or a callable, got {type(mod).__name__}")


def get_mask_mod(mod: str | Callable) -> Callable:
    """A registered name or a callable → the mask mod."""
    return _lookup(_MASK_MODS, "mask_mod", mod)


def get_score_mod(mod: str | Callable | None) -> Callable | None:
    """A registered name, a callable or None → the score mod (None means identity)."""
    return None if mod is None else _lookup(_SCORE_MODS, "score_mod", mod)


def mod_name(fn: Callable) -> str:
    return getattr(fn, "mod_name", None) or getattr(fn, "__name__", type(fn).__name__)


_PARAMS_OF: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # function → {base_args: {name: dtype}}

# A parameter's annotation → the dtype of its [num_requests] tensor; unannotated means int64. Strings are
# what `from __future__ import annotations` leaves in the signature.
PARAM_DTYPES = {int: torch.int64, "int": torch.int64, float: torch.float32, "float": torch.float32}


def request_params(fn: Callable, base_args: tuple[str, ...]) -> dict[str, torch.dtype]:
    """The per-request parameters a mod reads (its arguments after the coordinates), each with its dtype.

    `def m(b, h, q_idx, kv_idx, prefix_len)` reads `prefix_len`, an int64 tensor indexed by request `b`;
    `def m(score, b, h, q_idx, kv_idx, cap: float)` reads `cap` as float32. Every step asks, so a plain
    function's answer is kept.
    """
    if not isinstance(fn, types.FunctionType):
        return _request_params(fn, base_args)
    known = _PARAMS_OF.setdefault(fn, {})
    if base_args not in known:
        known[base_args] = _request_params(fn, base_args)
    return known[base_args]


def _request_params(fn: Callable, base_args: tuple[str, ...]) -> dict[str, torch.dtype]:
    declared = getattr(fn, "request_params", None)  # composed masks declare theirs
    if declared is not None:
        return dict(declared)
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return {}
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return {}
    named = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return {p.name: param_dtype(fn, p) for p in named[len(base_args):]}


def param_dtype(fn: Callable, param: inspect.Parameter) -> torch.dtype:
    if param.annotation is param.empty:
        return torch.int64
    if param.annotation not in PARAM_DTYPES:
        raise ValueError(f"{mod_name(fn)}: per-request parameter {param.name!r} is annotated "
                         f"{getattr(param.annotation, '__name__', param.annotation)!r}; annotate it `int` (int64, "
                         f"the default) or `float` (float32)")
    return PARAM_DTYPES[param.annotation]


@dataclass(frozen=True)
class RequestParam:
    dtype: torch.dtype  # of its [num_requests] tensor
    mod: str            # the first mod that reads it, for error messages


def merge_request_params(mods) -> dict[str, RequestParam]:
    """The parameters of several (mod, base_args) pairs; a name read with two dtypes is a ValueError, since
    one tensor (and one compiled kernel) serves every mod that reads it."""
    merged = {}
    for fn, base_args in mods:
        for name, dtype in request_params(fn, base_args).items():
            seen = merged.setdefault(name, RequestParam(dtype, mod_name(fn)))
            if seen.dtype != dtype:
                raise ValueError(f"per-request parameter {name!r} is {seen.dtype} in {seen.mod} but {dtype} in "
                                 f"{mod_name(fn)}; annotate it the same way in both (`{name}: float` for float32)")
    return merged
