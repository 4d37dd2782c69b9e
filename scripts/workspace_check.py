"""GPU check of the workspace copy kernel and of one compiled prefill through it, against plain torch.

    python scripts/workspace_check.py
"""
import random
import sys

import torch

from flexengine.attention import paged_attention
from flexengine.attention.workspace import gather_pages

sys.path.insert(0, "tests")
from attention_reference import PLAIN_MASKS, dense_paged_attention, make_paged_batch  # noqa: E402

dev = "cuda"
kc = torch.randn(300, 16, 8, 128, device=dev, dtype=torch.bfloat16)
vc = torch.randn_like(kc)
src = torch.tensor([5, -1, 17, 299, -1, 0, 42], device=dev)
ks, vs = torch.full((10, 16, 8, 128), 7.0, device=dev, dtype=kc.dtype), torch.full((10, 16, 8, 128), 7.0, device=dev, dtype=kc.dtype)
gather_pages(kc, vc, src, ks, vs)
for i, p in enumerate(src.tolist()):
    want_k, want_v = (kc[p], vc[p]) if p >= 0 else (torch.full_like(kc[0], 7.0),) * 2
    assert torch.equal(ks[i], want_k) and torch.equal(vs[i], want_v), i
assert (ks[len(src):] == 7).all()
print("gather_pages: copies listed pages, skips -1, leaves the rest")

seq_lens, query_lens = [300, 129, 40, 200], [140, 64, 1, 130]
q, k, v, tables = make_paged_batch(random.Random(0), seq_lens, query_lens, 16, 4, 2, 64, dtype=torch.bfloat16,
                                   device=dev, garbage=False)
args = (q, k, v, torch.tensor(tables, dtype=torch.int32, device=dev), torch.tensor(seq_lens, device=dev),
        torch.tensor(query_lens, device=dev))
out = paged_attention(*args, mask_mod="causal", backend="flex")
ref = dense_paged_attention(q, k, v, tables, seq_lens, query_lens, PLAIN_MASKS["causal"])
err = (out.double().cpu() - ref).abs().max().item()
print(f"compiled flex prefill through the workspace vs the dense reference: max error {err:.4f}")
assert err < 2e-2
