"""One decode request's attention call, by context: flex's decoding template (what the engine runs at batch 1:
the request's pages split over the kernel's own SPLIT_KV programs, then two reduction kernels over the splits)
against flex's main template (`kernel_options={"BACKEND": "TRITON"}`, one program per query head, no split and no
reduction). Issue 16: at batch 1 and a 128-token context the decode attention took 169 µs of a 1,401 µs step
(three kernels a layer, 16 layers; session 21's profile), for one page per layer.

    python3 scripts/decode_kernel_probe.py [--contexts 128,256,512,1024,2048,4096] [--shapes 1b,8b_tp2]

For each shape and context: µs per call, with `--calls` calls captured in one CUDA graph (launch gaps included, as
in the engine's decode graph), the kernels per call, and the largest difference between the two outputs. The KV
pool is shuffled and sized for the longest context, so each variant compiles once. A probe for a decision, not part
of the engine; the CPU runs it eagerly on tiny shapes (the same code path, no timing).
"""
from __future__ import annotations

import argparse
import json

import torch

from flexengine import masks
from flexengine.attention.backends.flex import FlexBackend
from flexengine.attention.backends.flex_kernels import decode_kernel_options
from flexengine.attention.layout import choose_decode_splits, plan_layout
from flexengine.attention.metadata import build_metadata
from flexengine.benchmarks.common import graph_us

SHAPES = {"1b": (32, 8, 64), "8b_tp2": (16, 4, 128), "8b": (32, 8, 128)}  # (Hq, Hkv, D)


def decode_call(backend, q, kc, vc, table, ctx: int, splits: int, options: dict):
    """A function running one decode row's flex call as FlexBackend.forward's decode_in_place branch does, with
    `options` in place of its kernel options."""
    P, NB = kc.shape[1], kc.shape[0]
    seq_lens = torch.tensor([ctx], dtype=torch.int32, device=q.device)
    meta = build_metadata(table, seq_lens, torch.empty(0, dtype=torch.long, device=q.device),
                          plan_layout([1], [ctx], decode_splits=splits), P, NB)
    meta.backend = backend
    mods = (masks.get_mask_mod("causal"), None)
    backend.prepare(meta, [mods])
    assert meta.layout.decode_in_place, meta.layout
    block_mask = meta.backend_state["masks"][mods[0]][0]
    k = kc.view(1, NB * P, *kc.shape[2:]).transpose(1, 2)
    v = vc.view(1, NB * P, *vc.shape[2:]).transpose(1, 2)
    flex = backend.flex_fn()
    scale = q.shape[-1] ** -0.5
    return lambda: flex(q.unsqueeze(2), k, v, block_mask=block_mask, scale=scale, enable_gqa=True,
                        kernel_options=options)[:, :, 0]


def timed_with_kernels(fn, calls: int) -> tuple[float, int]:
    """(µs per call over `calls` calls in one CUDA graph; kernels per call, counted in one profiled replay)."""
    us, graph = graph_us(lambda i: fn(), calls, repeats=20)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    return us, sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) // calls


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="128,256,512,1024,2048,4096")
    p.add_argument("--shapes", default="1b,8b_tp2")
    p.add_argument("--page", type=int, default=128)
    p.add_argument("--calls", type=int, default=16)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    contexts = [int(c) for c in args.contexts.split(",")]
    if not cuda:
        contexts = [c for c in contexts if c <= 512][:2] or [64]
    g = torch.Generator(device=device).manual_seed(0)
    P = args.page
    if cuda:
        print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | bf16 | page {P} | µs per call, "
              f"{args.calls} calls per CUDA graph")
    print("| shape (Hq, Hkv, D) | context | decoding template, kernel splits µs (kernels) | main template, no split "
          "µs (kernels) | main / decoding | max diff |")
    print("|---|---|---|---|---|---|")
    results = []
    for shape in args.shapes.split(","):
        Hq, Hkv, D = SHAPES[shape]
        dtype = torch.bfloat16 if cuda else torch.float32
        NB = -(-max(contexts) // P) + 8
        kc = torch.randn(NB, P, Hkv, D, generator=g, device=device).to(dtype)
        vc = torch.randn(NB, P, Hkv, D, generator=g, device=device).to(dtype)
        q = torch.randn(1, Hq, D, generator=g, device=device).to(dtype)
        pages = torch.randperm(NB, generator=torch.Generator().manual_seed(1))
        table = pages[None, :].to(torch.int32).to(device)
        backend = FlexBackend(compile=cuda)
        splits = choose_decode_splits(1, Hkv, device)
        for ctx in contexts:
            decoding = decode_call(backend, q, kc, vc, table, ctx, splits, decode_kernel_options(P, splits, q))
            main_t = decode_call(backend, q, kc, vc, table, ctx, 1, {"BACKEND": "TRITON"} if cuda else {})
            diff = (decoding().float() - main_t().float()).abs().max().item()
            (a, ka), (b, kb) = (timed_with_kernels(decoding, args.calls), timed_with_kernels(main_t, args.calls)) if cuda else ((0, 0), (0, 0))
            print(f"| {shape} ({Hq}, {Hkv}, {D}) | {ctx} | {a:.1f} ({ka}) | {b:.1f} ({kb}) | "
                  f"{b / a if a else 0:.2f} | {diff:.1e} |", flush=True)
            results.append(dict(shape=shape, ctx=ctx, decoding_us=a, decoding_kernels=ka, main_us=b,
                                main_kernels=kb, max_diff=diff))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
