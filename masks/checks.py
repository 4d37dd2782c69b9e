"""Check a user's mod once, on a tiny example, so mistakes surface as a ValueError naming the mod
instead of an Inductor stack trace."""
from __future__ import annotations

import torch

from .registry import MASK_ARGS, SCORE_ARGS, mod_name, request_params


def _grid(fn, n_args):
    """vmap over each coordinate, the way FlexAttention evaluates a mod on scalar indices."""
    for dim in reversed(range(n_args)):
        in_dims = [None] * n_args
        in_dims[dim] = 0
        fn = torch.vmap(fn, in_dims=tuple(in_dims))
    return fn


def _describe(kind, fn, err: Exception) -> ValueError:
    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    if "data-dependent control flow" in str(err) or "Boolean value of Tensor" in str(err):
        return ValueError(f"{kind} {mod_name(fn)} uses Python control flow on tensors (if/while/and/or on "
                          f"q_idx, kv_idx, ...); use torch.where or & | ~ instead ({text})")
    return ValueError(f"{kind} {mod_name(fn)} raised {type(err).__name__} on a 2x4x4 example: {text}")


def check_mask_mod(fn, params: dict | None = None, device="cpu") -> None:
    values = [torch.as_tensor(params[n], device=device) for n in request_params(fn, MASK_ARGS)] if params else []
    b, h, q, kv = (torch.arange(n, device=device) for n in (1, 2, 4, 4))
    try:
        out = _grid(lambda *a: fn(*a, *values), 4)(b, h, q, kv)
    except Exception as err:  # reported, not swallowed: any failure becomes a ValueError naming the mod
        raise _describe("mask_mod", fn, err) from err
    if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
        got = out.dtype if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"mask_mod {mod_name(fn)} must return a bool tensor, got {got}")
    if out.shape != (1, 2, 4, 4):
        raise ValueError(f"mask_mod {mod_name(fn)} must return one bool per (b, h, q_idx, kv_idx); on scalar "
                         f"indices it returned shape {tuple(out.shape[4:])}")


def check_score_mod(fn, params: dict | None = None, device="cpu", num_heads: int | None = None) -> None:
    num_heads = num_heads or getattr(fn, "num_heads", None) or 2  # alibi knows its head count
    values = [torch.as_tensor(params[n], device=device) for n in request_params(fn, SCORE_ARGS)] if params else []
    score = torch.zeros(1, num_heads, 4, 4, device=device)
    b, h, q, kv = (torch.arange(n, device=device) for n in (1, num_heads, 4, 4))

    def one(s, b_, h_, q_, kv_):
        return fn(s, b_, h_, q_, kv_, *values)

    fn5 = one
    for dim in reversed(range(1, 5)):  # vmap the score along with each coordinate
        in_dims = [None] * 5
        in_dims[0], in_dims[dim] = 0, 0
        fn5 = torch.vmap(fn5, in_dims=tuple(in_dims))
    try:
        out = fn5(score, b, h, q, kv)
    except Exception as err:
        raise _describe("score_mod", fn, err) from err
    if not isinstance(out, torch.Tensor) or not out.dtype.is_floating_point or out.shape != score.shape:
        got = (out.dtype, tuple(out.shape)) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"score_mod {mod_name(fn)} must return a float score per element, got {got}")
