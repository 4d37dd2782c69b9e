"""FA4's prefill tile at head size 64, on a GPU box with FlashAttention-4 (issue 24).

flash-attn-4's SM90 forward takes 192 x 128 tiles at head size <= 64 only when the block mask's q block is a
multiple of 192 (`_tile_size_fwd_sm90`); the engine's q block is 128, so FA4 runs 128 x 128 tiles. This times
flex's FLASH backend on the long-prompt shapes with q blocks of 128, 192 and 384 (kv block 128, the page), and
checks that each gives the same output as the 128 one.

    python3 scripts/fa4_tile_probe.py [--q-blocks 128,192,384] [--cases 8192x65536,...]
"""
from __future__ import annotations

import argparse

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


def chunk_causal(offset: int):
    """A chunk of queries at logical positions offset .. offset + Lq - 1 over keys 0 .. offset + Lq - 1."""
    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset
    return mask_mod


def time_ms(fn, iters: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--q-blocks", default="128,192,384")
    ap.add_argument("--cases", default="8192x65536,8192x16384,16384x16384",
                    help="LqxLk: a chunk of Lq queries ending a context of Lk keys")
    ap.add_argument("--heads", default="32,8,64", help="Hq,Hkv,D")
    args = ap.parse_args()
    Hq, Hkv, D = (int(x) for x in args.heads.split(","))
    attend = torch.compile(flex_attention, dynamic=False)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} Hq={Hq} Hkv={Hkv} D={D}")
    print("| Lq x Lk | q block | ms | TFLOP/s | max |diff| vs q block 128 |")
    print("|---|---|---|---|---|")
    for case in args.cases.split(","):
        Lq, Lk = (int(x) for x in case.split("x"))
        offset = Lk - Lq
        q = torch.randn(1, Hq, Lq, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, Hkv, Lk, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        flop = 4 * Hq * D * (Lq * offset + Lq * (Lq + 1) / 2)  # QK^T and PV over the live scores
        ref = None
        for qb in (int(x) for x in args.q_blocks.split(",")):
            bm = create_block_mask(chunk_causal(offset), 1, 1, Lq, Lk, device="cuda", BLOCK_SIZE=(qb, 128))
            fn = lambda: attend(q, k, v, block_mask=bm, enable_gqa=True,  # noqa: E731
                                kernel_options={"BACKEND": "FLASH"})
            out = fn()
            ref = out if ref is None else ref
            diff = (out.float() - ref.float()).abs().max().item()
            ms = time_ms(fn)
            print(f"| {Lq} x {Lk} | {qb} | {ms:.3f} | {flop / ms / 1e9:.0f} | {diff:.2e} |", flush=True)


if __name__ == "__main__":
    main()
