"""GPU repro: compiled flex decode rows vs the dense reference over GQA ratios, head sizes and splits."""
import random, sys, torch
sys.path.insert(0, "tests")
from attention_reference import PLAIN_MASKS, dense_paged_attention, make_paged_batch
from flexengine import masks
from flexengine.attention.backends import flex as fb
from flexengine.attention.metadata import build_metadata, plan_layout
from flexengine.compile import allow_recompiles
allow_recompiles(400)
orig = fb._pool_wide
def dense_pool_wide(idx, n):
    out = idx.new_zeros(idx.shape[0], n); m = min(n, idx.shape[1]); out[:, :m] = idx[:, :m]; return out
for contiguous in (False, True):
    fb._pool_wide = dense_pool_wide if contiguous else orig
    for Hq, Hkv, D in [(3, 1, 16), (4, 1, 16), (2, 1, 16), (3, 1, 32), (6, 2, 16), (3, 1, 128), (32, 8, 64)]:
        for seq_lens in ([1, 1], [40, 70], [1, 300, 17]):
            for S in (1, 2, 32):
                ql = [1] * len(seq_lens)
                q, kc, vc, tables = make_paged_batch(random.Random(0), seq_lens, ql, 16, Hq, Hkv, D,
                                                     dtype=torch.bfloat16, device="cuda")
                meta = build_metadata(torch.tensor(tables, dtype=torch.int32, device="cuda"),
                                      torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
                                      torch.empty(0, dtype=torch.long, device="cuda"),
                                      plan_layout(ql, seq_lens, decode_splits=S), 16, kc.shape[0])
                meta.backend = b = fb.FlexBackend()
                out = b.forward(q, kc, vc, meta, masks.causal, None, D ** -0.5).double().cpu()
                ref = dense_paged_attention(q, kc, vc, tables, seq_lens, ql, PLAIN_MASKS["causal"], scale=D ** -0.5)
                err = (out - ref).abs().amax(dim=(1, 2)).tolist()
                bad = [i for i, e in enumerate(err) if e > 2e-2]
                print(f"contig={int(contiguous)} Hq={Hq} Hkv={Hkv} D={D} lens={seq_lens} S={S}: "
                      f"{'OK' if not bad else 'BAD rows ' + str(bad)}", flush=True)
