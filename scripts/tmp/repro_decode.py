"""GPU repro: compiled flex decode rows vs the dense reference. argv: which ("first" | "grid")."""
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
def case(contiguous, Hq, Hkv, D, seq_lens, S, seed=0, bs=16):
    fb._pool_wide = dense_pool_wide if contiguous else orig
    ql = [1] * len(seq_lens)
    q, kc, vc, tables = make_paged_batch(random.Random(seed), seq_lens, ql, bs, Hq, Hkv, D, dtype=torch.bfloat16, device="cuda")
    meta = build_metadata(torch.tensor(tables, dtype=torch.int32, device="cuda"), torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
                          torch.empty(0, dtype=torch.long, device="cuda"), plan_layout(ql, seq_lens, decode_splits=S), bs, kc.shape[0])
    meta.backend = b = fb.FlexBackend()
    out = b.forward(q, kc, vc, meta, masks.causal, None, D ** -0.5).double().cpu()
    ref = dense_paged_attention(q, kc, vc, tables, seq_lens, ql, PLAIN_MASKS["causal"], scale=D ** -0.5)
    err = (out - ref).abs().amax(dim=(1, 2)).tolist()
    bad = [i for i, e in enumerate(err) if e > 2e-2]
    print(f"contig={int(contiguous)} Hq={Hq} Hkv={Hkv} D={D} lens={seq_lens} S={S} M={len(tables[0])} pool={kc.shape[0]}: "
          f"{'OK' if not bad else 'BAD rows ' + str(bad)}", flush=True)
if sys.argv[1] == "first":
    case(False, 3, 1, 16, [1, 1], 32)
else:
    for Hq, Hkv, D in [(3, 1, 16), (4, 1, 64), (8, 2, 64)]:
        for lens in ([1, 1], [1, 1, 1], [1] * 4, [40, 70], [1] * 8):
            for S in (1, 32):
                for contiguous in (False, True):
                    case(contiguous, Hq, Hkv, D, lens, S)
    for seed in range(1, 6):
        case(False, 3, 1, 16, [1, 1], 32, seed=seed)
