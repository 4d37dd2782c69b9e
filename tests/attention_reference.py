"""An independent dense reference for paged attention, written as plainly as possible.

It reads each key by walking the block table entry by entry and evaluates masks one (q, kv) pair at a
time with Python ints, so it shares no code path with the engine.
"""
import math
import random

import torch


def dense_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_lens,
                          allowed, score=None, scale=None):
    """allowed(b, h, q, kv) -> bool and score(s, b, h, q, kv) -> float take Python numbers."""
    T, Hq, D = query.shape
    _, P, Hkv, _ = key_cache.shape
    scale = 1 / math.sqrt(D) if scale is None else scale
    q64, k64, v64 = query.double().cpu(), key_cache.double().cpu(), value_cache.double().cpu()
    out = torch.zeros(T, Hq, D, dtype=torch.float64)
    start = 0
    for b, (L, n) in enumerate(zip(seq_lens, query_lens)):
        keys = [k64[block_tables[b][pos // P], pos % P] for pos in range(L)]
        vals = [v64[block_tables[b][pos // P], pos % P] for pos in range(L)]
        for t in range(n):
            qpos = L - n + t
            for h in range(Hq):
                kh = h // (Hq // Hkv)
                logits, rows = [], []
                for kv in range(L):
                    if allowed(b, h, qpos, kv):
                        s = float(q64[start + t, h] @ keys[kv][kh]) * scale
                        logits.append(score(s, b, h, qpos, kv) if score else s)
                        rows.append(vals[kv][kh])
                if logits:
                    w = torch.softmax(torch.tensor(logits, dtype=torch.float64), 0)
                    out[start + t, h] = (w[:, None] * torch.stack(rows)).sum(0)
        start += n
    return out


def as_plain(mod):
    """A tensor mod evaluated on Python ints, for user mods that have no separate plain spelling."""
    return lambda b, h, q, kv: bool(mod(torch.tensor(b), torch.tensor(h), torch.tensor(q), torch.tensor(kv)))


PLAIN_MASKS = {
    "causal": lambda b, h, q, kv: kv <= q,
    "bidirectional": lambda b, h, q, kv: True,
    "sliding_window": lambda W: (lambda b, h, q, kv: 0 <= q - kv < W),
    "chunked_local": lambda C: (lambda b, h, q, kv: kv <= q and q // C == kv // C),
    "prefix_lm": lambda Pf: (lambda b, h, q, kv: kv <= q or kv < Pf),
}


def make_paged_batch(rng: random.Random, seq_lens, query_lens, block_size, Hq, Hkv, D, spare_blocks=3,
                     dtype=torch.float32, device="cpu", garbage=True):
    """Random K/V in a shuffled page pool; block table columns past each request's pages are garbage."""
    pages = [(L + block_size - 1) // block_size for L in seq_lens]
    num_blocks = sum(pages) + spare_blocks
    order = list(range(num_blocks))
    rng.shuffle(order)
    width = max(pages) + rng.randint(0, 2)
    tables, used = [], 0
    for n in pages:
        row = order[used:used + n] + [rng.randint(0, 10 * num_blocks) if garbage else 0 for _ in range(width - n)]
        tables.append(row)
        used += n
    g = torch.Generator().manual_seed(rng.randint(0, 2**31))
    kc = torch.randn(num_blocks, block_size, Hkv, D, generator=g).to(dtype)
    vc = torch.randn(num_blocks, block_size, Hkv, D, generator=g).to(dtype)
    q = torch.randn(sum(query_lens), Hq, D, generator=g).to(dtype)
    return q.to(device), kc.to(device), vc.to(device), tables
