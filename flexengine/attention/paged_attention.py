"""The functional API: attention for a packed batch of new tokens over a paged KV cache."""
from __future__ import annotations

import weakref

import torch

from ..masks import check_mask_mod, check_score_mod, get_mask_mod, get_score_mod, mod_name
from .backends import get_backend
from .metadata import build_metadata
from .layout import choose_decode_splits, plan_layout


def _check_inputs(query, key_cache, value_cache, block_tables, seq_lens, query_lens):
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, Hq, D], got shape {tuple(query.shape)}")
    if key_cache.dim() != 4:
        raise ValueError(f"key_cache must be [num_blocks, block_size, Hkv, D], got shape {tuple(key_cache.shape)}")
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache shape {tuple(value_cache.shape)} != key_cache shape {tuple(key_cache.shape)}")
    T, Hq, D = query.shape
    NB, P, Hkv, Dk = key_cache.shape
    if Dk != D:
        raise ValueError(f"head size mismatch: query has D={D}, key_cache has D={Dk}")
    if Hq % Hkv:
        raise ValueError(f"Hq={Hq} is not a multiple of Hkv={Hkv}")
    if not (query.dtype == key_cache.dtype == value_cache.dtype):
        raise ValueError(f"dtype mismatch: query {query.dtype}, key_cache {key_cache.dtype}, value_cache {value_cache.dtype}")
    tensors = dict(query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
                   seq_lens=seq_lens, query_lens=query_lens)
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError("device mismatch: " + ", ".join(f"{n} on {d}" for n, d in devices.items()))
    for name in ("block_tables", "seq_lens", "query_lens"):
        t = tensors[name]
        if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
            raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
    if block_tables.dim() != 2 or seq_lens.dim() != 1 or query_lens.dim() != 1:
        raise ValueError("block_tables must be 2-D and seq_lens, query_lens 1-D")
    R = block_tables.shape[0]
    if seq_lens.shape[0] != R or query_lens.shape[0] != R:
        raise ValueError(f"block_tables has {R} rows but seq_lens has {seq_lens.shape[0]} and query_lens "
                         f"{query_lens.shape[0]}")
    ql, sl = query_lens.tolist(), seq_lens.tolist()  # the functional API may sync; the engine passes host lists
    if any(n < 1 for n in ql):
        raise ValueError(f"query_lens must be >= 1, got {ql}")
    if sum(ql) != T:
        raise ValueError(f"query_lens sum to {sum(ql)} but query has {T} tokens")
    for i, (n, L) in enumerate(zip(ql, sl)):
        if n > L:
            raise ValueError(f"request {i}: query_len {n} is longer than its context seq_len {L}")
        pages = (L + P - 1) // P
        if pages > block_tables.shape[1]:
            raise ValueError(f"request {i}: block table is too short: seq_len {L} needs {pages} pages of "
                             f"{P}, the table has {block_tables.shape[1]} columns")
        used = block_tables[i, :pages]
        if pages and (int(used.min()) < 0 or int(used.max()) >= NB):
            raise ValueError(f"request {i}: block table entries must be in [0, {NB}), got {used.tolist()}")
    return ql, sl


# mod → {(device, heads, requests): the longest sequence it was checked on}; weak, as mods are often made per call
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_mods(mask_fn, score_fn, params: dict, num_heads: int, seq_lens: list[int], device) -> None:
    """Check each mod on the coordinates this call will give it; again only when a call reaches further."""
    num_reqs, max_len = len(seq_lens), max(seq_lens)
    for fn, check in ((mask_fn, check_mask_mod), (score_fn, check_score_mod)):
        if fn is None:
            continue
        try:
            seen = _CHECKED.setdefault(fn, {})
        except TypeError:  # not weakly referable (a builtin): checked every call
            seen = {}
        key = (device, num_heads, num_reqs)
        if seen.get(key, 0) < max_len:
            check(fn, params, device, num_heads=num_heads, max_len=max_len, limit="the longest seq_len",
                  seq_lens=seq_lens)
            seen[key] = max_len


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_lens, *,
                    mask_mod="causal", score_mod=None, scale=None, backend=None, attention_params=None):
    """Attention of the packed new tokens `query` [T, Hq, D] over the paged cache → [T, Hq, D].

    The caches already hold the new tokens' K/V. Request i's queries are the last query_lens[i] of its
    seq_lens[i] positions. `attention_params` maps a per-request parameter name to a [num_reqs] tensor.
    """
    ql, sl = _check_inputs(query, key_cache, value_cache, block_tables, seq_lens, query_lens)
    mask_fn, score_fn = get_mask_mod(mask_mod), get_score_mod(score_mod)
    Hq, D = query.shape[1], query.shape[2]
    heads = getattr(score_fn, "num_heads", None)
    if heads is not None and heads != Hq:
        raise ValueError(f"{mod_name(score_fn)} has {heads} slopes but the query has {Hq} heads")
    impl = get_backend(backend, [(mask_fn, score_fn)], head_dim=D, block_size=key_cache.shape[1], dtype=query.dtype)
    NB, P, Hkv = key_cache.shape[:3]
    splits = choose_decode_splits(sum(n == 1 for n in ql), Hkv, query.device)
    layout = plan_layout(ql, sl, decode_splits=splits, block_size=P, q_tiles=getattr(impl, "q_tiles", 1))
    params = {k: torch.as_tensor(v, device=query.device) for k, v in (attention_params or {}).items()}
    check_mods(mask_fn, score_fn, params, Hq, sl, query.device)
    meta = build_metadata(block_tables.to(torch.int32), seq_lens.to(torch.int32),
                          torch.empty(0, dtype=torch.long, device=query.device), layout, P, NB, params)
    meta.backend = impl
    impl.prepare(meta, [(mask_fn, score_fn)])
    return impl.forward(query, key_cache, value_cache, meta, mask_fn, score_fn, D ** -0.5 if scale is None else scale)
