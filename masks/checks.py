"""Check a user's mod once, eagerly, on the coordinates it will really see, so that mistakes surface as a
ValueError naming the mod instead of an Inductor stack trace or an out-of-bounds read in a kernel.

The engine calls a mod only with `b` a live request, `h` in [0, num_heads) and positions in
[0, max_len) (docs/attention.md), so the check evaluates it on exactly those ranges: every head, the
first and the last positions, and per-request parameters as [num_reqs] tensors.
"""
from __future__ import annotations

import torch

from .registry import MASK_ARGS, SCORE_ARGS, mod_name, request_params

COORDS = ("b", "h", "q_idx", "kv_idx")


def vmap_over_coords(fn, n_args, first=0):
    """vmap over each coordinate, the way FlexAttention evaluates a mod on scalar indices; arguments
    before `first` (a score) are mapped along with every coordinate."""
    for dim in reversed(range(first, n_args)):
        in_dims = [None] * n_args
        in_dims[dim] = 0
        for d in range(first):
            in_dims[d] = 0
        fn = torch.vmap(fn, in_dims=tuple(in_dims))
    return fn


def _positions(max_len: int, device) -> torch.Tensor:
    """The first positions and the last two: where a table indexed by a position (or by a difference of
    positions) first runs out."""
    return torch.tensor(sorted({p for p in (0, 1, 2, 3, max_len - 2, max_len - 1) if 0 <= p < max_len}), device=device)


def _coords(num_reqs: int, num_heads: int, max_len: int, device) -> dict[str, torch.Tensor]:
    pos = _positions(max_len, device)
    return {"b": torch.arange(num_reqs, device=device), "h": torch.arange(num_heads, device=device),
            "q_idx": pos, "kv_idx": pos}


def _evaluate(fn, coords: dict[str, torch.Tensor], values, score: bool):
    b, h, q, kv = (coords[c] for c in COORDS)
    if not score:
        return vmap_over_coords(lambda *a: fn(*a, *values), 4)(b, h, q, kv)
    s = torch.zeros(len(b), len(h), len(q), len(kv), device=b.device)
    return vmap_over_coords(lambda s_, *a: fn(s_, *a, *values), 5, first=1)(s, b, h, q, kv)


def _culprit(fn, coords, values, score: bool) -> str | None:
    """The one coordinate whose range alone makes the mod raise (others held at 0), if there is one."""
    for name in ("h", "q_idx", "kv_idx", "b"):
        alone = {c: (t if c == name else t[:1]) for c, t in coords.items()}
        try:
            _evaluate(fn, alone, values, score)
        except Exception:  # noqa: BLE001 - this only locates the failure the caller reports
            return name
    return None


def _describe(kind, fn, err: Exception, coords, values, score: bool, limit: str) -> ValueError:
    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    if "data-dependent control flow" in str(err) or "Boolean value of Tensor" in str(err):
        return ValueError(f"{kind} {mod_name(fn)} uses Python control flow on tensors (if/while/and/or on "
                          f"q_idx, kv_idx, ...); use torch.where or & | ~ instead ({text})")
    R, H, L = len(coords["b"]), len(coords["h"]), int(coords["q_idx"].max()) + 1
    ranges = {"b": f"b in [0, {R}) (requests of a step)", "h": f"h in [0, {H}) (the layer's query heads)",
              "q_idx": f"q_idx in [0, {L}) ({limit} {L})", "kv_idx": f"kv_idx in [0, {L}) ({limit} {L})"}
    name = _culprit(fn, coords, values, score) if isinstance(err, (IndexError, RuntimeError)) else None
    where = ranges[name] if name else ", ".join(ranges.values())
    hint = ""
    if isinstance(err, IndexError):
        hint = (f"; a mod may index a tensor it captures by position when it holds {limit} ({L}) entries, "
                f"by head when it holds {H}, and per-request parameters are [{R}]-shaped here")
    return ValueError(f"{kind} {mod_name(fn)} raised {type(err).__name__} on {where}: {text}{hint}")


def _values(fn, base_args, params, num_reqs: int, device) -> list[torch.Tensor]:
    """Each per-request parameter as the [num_reqs] tensor the engine passes: the caller's values if
    it gave some, else ones of the declared dtype."""
    out = []
    for name, dtype in request_params(fn, base_args).items():
        if params and name in params:
            out.append(torch.as_tensor(params[name], device=device))
        else:
            out.append(torch.ones(num_reqs, dtype=dtype, device=device))
    return out


def _run(kind, fn, score: bool, params, device, num_heads, max_len, num_reqs, limit, seq_lens):
    """Evaluate the mod on every head, requests [0, num_reqs) and positions reaching max_len - 1; with
    `seq_lens` (a call's own lengths), the far positions only on the requests that have them."""
    num_reqs = len(seq_lens) if seq_lens else num_reqs or (len(next(iter(params.values()))) if params else 1)
    coords = _coords(num_reqs, num_heads, max_len, device)
    grids = [coords]
    if seq_lens:
        longest = torch.tensor([i for i, L in enumerate(seq_lens) if L == max_len], device=device)
        grids = [{**coords, "b": longest}, {**coords, "q_idx": coords["q_idx"][:1], "kv_idx": coords["kv_idx"][:1]}]
    values = _values(fn, SCORE_ARGS if score else MASK_ARGS, params, num_reqs, device)
    try:
        outs = [_evaluate(fn, grid, values, score) for grid in grids]
    except Exception as err:  # reported, not swallowed: any failure becomes a ValueError naming the mod
        raise _describe(kind, fn, err, coords, values, score, limit) from err
    return outs[0], tuple(len(grids[0][c]) for c in COORDS)


def check_mask_mod(fn, params: dict | None = None, device="cpu", *, num_heads: int = 2, max_len: int = 4,
                   num_reqs: int | None = None, limit: str = "max_model_len",
                   seq_lens: list[int] | None = None) -> None:
    """Evaluate `fn` on requests [0, num_reqs), heads [0, num_heads) and positions reaching max_len - 1
    (`limit` names what bounds the positions, for the error)."""
    out, expect = _run("mask_mod", fn, False, params, device, num_heads, max_len, num_reqs, limit, seq_lens)
    if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
        got = out.dtype if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"mask_mod {mod_name(fn)} must return a bool tensor, got {got}")
    if tuple(out.shape) != expect:
        raise ValueError(f"mask_mod {mod_name(fn)} must return one bool per (b, h, q_idx, kv_idx); on scalar "
                         f"indices it returned shape {tuple(out.shape[4:])}")


def check_score_mod(fn, params: dict | None = None, device="cpu", num_heads: int | None = None, *, max_len: int = 4,
                    num_reqs: int | None = None, limit: str = "max_model_len",
                   seq_lens: list[int] | None = None) -> None:
    num_heads = num_heads or getattr(fn, "num_heads", None) or 2  # alibi knows its head count
    out, expect = _run("score_mod", fn, True, params, device, num_heads, max_len, num_reqs, limit, seq_lens)
    if not isinstance(out, torch.Tensor) or not out.dtype.is_floating_point or tuple(out.shape) != expect:
        got = (out.dtype, tuple(out.shape)) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"score_mod {mod_name(fn)} must return a float score per element, got {got}")
