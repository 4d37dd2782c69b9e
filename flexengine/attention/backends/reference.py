"""Dense attention over each request's gathered K/V: slow, obvious, for tests and debugging."""
from __future__ import annotations

import torch

from ...masks import MASK_ARGS, SCORE_ARGS
from ..metadata import AttentionMetadata
from .paged_mods import param_values


class ReferenceBackend:
    name = "reference"

    def prepare(self, meta: AttentionMetadata, mods) -> None:
        pass

    def forward(self, query, key_cache, value_cache, meta: AttentionMetadata, mask_mod, score_mod, scale):
        T, Hq, D = query.shape
        NB, P, Hkv, _ = key_cache.shape
        mvals = param_values(meta, mask_mod, MASK_ARGS)
        svals = param_values(meta, score_mod, SCORE_ARGS) if score_mod is not None else []
        seq_lens, query_lens = meta.layout.seq_lens, meta.layout.query_lens
        out = torch.empty_like(query)
        start = 0
        h = torch.arange(Hq, device=query.device)[:, None, None]
        for i, (L, n) in enumerate(zip(seq_lens, query_lens)):
            pages = meta.block_tables[i, : (L + P - 1) // P].long()
            k = key_cache[pages].reshape(-1, Hkv, D)[:L].float().repeat_interleave(Hq // Hkv, dim=1)
            v = value_cache[pages].reshape(-1, Hkv, D)[:L].float().repeat_interleave(Hq // Hkv, dim=1)
            q = query[start:start + n].float()
            b = torch.tensor(i, device=query.device)
            q_pos = torch.arange(L - n, L, device=query.device)[None, :, None]
            kv_pos = torch.arange(L, device=query.device)[None, None, :]
            s = torch.einsum("qhd,khd->hqk", q, k) * scale
            if score_mod is not None:
                s = score_mod(s, b, h, q_pos, kv_pos, *svals)
            allowed = mask_mod(b, h, q_pos, kv_pos, *mvals).expand_as(s)
            s = s.masked_fill(~allowed, float("-inf"))
            p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a fully masked row gives 0, as flex does
            out[start:start + n] = torch.einsum("hqk,khd->qhd", p, v).to(query.dtype)
            start += n
        return out
