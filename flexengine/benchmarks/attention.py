"""Paged flex attention against torch SDPA (flash) on dense tensors, measured in the same run.

    python -m flexengine.benchmarks.attention [--page-sizes 128 16] [--mask causal] [--score softcap:30] [--json out.json]

Rows follow DESIGN.md's baselines: Hq=32, Hkv=8, D=128, bf16. Floors: decode = K/V bytes / the HBM
bandwidth (common.HBM_BYTES_PER_S: 3.0 TB/s on an H100, 4.3 on an H200); prefill = causal FLOPs / 790 TFLOP/s
(dense bf16, the same on both). "meta" is the whole per-step metadata build (layout planning on the host, page
map, page lists and BlockMasks on the device), as host wall time per step; flex and SDPA are kernel times (flex
replayed from a CUDA graph, as the engine runs it).
"""
from __future__ import annotations

import argparse
import random

import torch
import torch.nn.functional as F

from ..attention.backends import flex as flex_backend
from ..attention.backends import prefill_kernel
from ..attention.backends.flex import FlexBackend
from ..attention.metadata import build_metadata
from ..attention.layout import choose_decode_splits, plan_layout, workspace_tokens
from ..compile import compile_count
from .. import masks
from .common import hbm_bytes_per_s, write_json

BF16_FLOPS = 790e12
DECODE = [(1, 4096), (8, 8192), (32, 512), (64, 2048), (256, 1024)]
PREFILL = [(8, 1024), (2, 4096), (32, 512)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--page-sizes", type=int, nargs="+", default=[128, 16], help="KV page sizes to measure")
    p.add_argument("--heads", type=int, default=32, help="query heads")
    p.add_argument("--kv-heads", type=int, default=8, help="key/value heads")
    p.add_argument("--head-dim", type=int, default=128, help="head size")
    p.add_argument("--mask", default="causal", help="the mask: causal, sliding_window:W, chunked_local:C, "
                   "user_causal (causal as a plain user function, without the built-in's bounds: every page of the "
                   "request is partial, so the mask runs on every element), or causal_and_user (a user function "
                   "without bounds composed with causal, as docs/attention.md serves attention-gym's masks)")
    p.add_argument("--score", default=None, help="a score mod: softcap:C, alibi, or a registered name (default none)")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    p.add_argument("--decode-only", action="store_true", help="only the decode rows (a quick check of the decode kernel)")
    p.add_argument("--prefill-from", choices=("pages", "workspace"), default="pages",
                   help="where 128-token pages prefill from: the pool in place (the engine's default) or a copy in the "
                        "workspace (as smaller pages do)")
    p.add_argument("--fa4-q-tiles", type=int, default=None, metavar="N",
                   help="128-row prefill tiles per q block of the FA4 call (default 1, as the engine takes for these "
                        "rows' short contexts; it takes 3 for long ones on Hopper at head size <= 64: compile.wide_q_tiles)")
    p.add_argument("--decode-cases", default=None, metavar="BxCTX,...",
                   help="the decode rows, as batch x context pairs (default: " +
                        ",".join(f"{b}x{c}" for b, c in DECODE) + ")")


def user_causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def user_window(b, h, q_idx, kv_idx):  # symmetric and wider than any benchmarked context: allows everything
    return (q_idx - kv_idx).abs() < 1 << 20


def parse_mods(mask: str, score: str | None, num_heads: int):
    """--mask / --score → (mask_mod, score_mod)."""
    name, _, arg = mask.partition(":")
    if name == "user_causal":
        mask_mod = user_causal
    elif name == "causal_and_user":
        mask_mod = masks.and_masks("causal", user_window)
    elif name in ("sliding_window", "chunked_local"):
        mask_mod = getattr(masks, name)(int(arg))
    else:
        mask_mod = masks.get_mask_mod(mask)
    name, _, arg = (score or "").partition(":")
    if name == "softcap":
        score_mod = masks.softcap(float(arg))
    elif name == "alibi":  # the ALiBi paper's slopes for num_heads heads
        score_mod = masks.alibi([2.0 ** (-8 * (i + 1) / num_heads) for i in range(num_heads)])
    else:
        score_mod = masks.get_score_mod(score or None)
    return mask_mod, score_mod


def bench(fn) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=100) * 1000.0  # µs


def paged_step(seq_lens, query_lens, page, Hq, Hkv, D, device, spare=64):
    """A shuffled pool holding the step's requests, its block tables, and a query."""
    pages = [(L + page - 1) // page for L in seq_lens]
    NB = sum(pages) + spare
    order = torch.randperm(NB, generator=torch.Generator().manual_seed(0)).tolist()
    width = max(pages)
    tables, used = [], 0
    for n in pages:
        tables.append(order[used:used + n] + [0] * (width - n))
        used += n
    kc = torch.randn(NB, page, Hkv, D, device=device, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(sum(query_lens), Hq, D, device=device, dtype=torch.bfloat16)
    return q, kc, vc, torch.tensor(tables, dtype=torch.int32, device=device)


def captured_flex_call(seq_lens, query_lens, page, Hq, Hkv, D, device, mods):
    """(a CUDA graph of one paged flex call over a shuffled pool, the step's metadata build): the engine replays
    attention inside CUDA graphs, so the kernels are timed, not Python dispatch."""
    q, kc, vc, bt = paged_step(seq_lens, query_lens, page, Hq, Hkv, D, device)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    backend = FlexBackend(compile=True)
    splits = choose_decode_splits(sum(n == 1 for n in query_lens), Hkv, device)
    slots = torch.empty(0, dtype=torch.long, device=device)

    def build():
        # wide q blocks only where --fa4-q-tiles asks: the engine takes them for long contexts (compile.wide_q_tiles),
        # which no row here has
        q_tiles = backend.q_tiles if prefill_kernel.FA4_Q_TILES else 1
        layout = plan_layout(query_lens, seq_lens, decode_splits=splits, block_size=page, q_tiles=q_tiles)
        meta = build_metadata(bt, sl, slots, layout, page, kc.shape[0])
        meta.backend = backend
        backend.prepare(meta, [mods])
        return meta

    # the prefill workspace reserved once, as the engine does (a fresh zeroed one per call is the functional API's)
    ws_pages = workspace_tokens(query_lens, seq_lens, page) // page
    if ws_pages:
        backend.reserve_workspace(ws_pages, page, Hkv, D, torch.bfloat16, device)
    meta = build()
    run = lambda: backend.forward(q, kc, vc, meta, *mods, D ** -0.5)  # noqa: E731
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph, build


def flex_times(seq_lens, query_lens, page, Hq, Hkv, D, device, mods):
    graph, build = captured_flex_call(seq_lens, query_lens, page, Hq, Hkv, D, device, mods)
    return bench(graph.replay), host_time(build)


def host_time(fn, n=50) -> float:
    """Wall time per call, launches included, synchronised once at the end (µs)."""
    import time
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e6


def sdpa_decode(B, ctx, Hq, Hkv, D, device):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q = torch.randn(B, Hq, 1, D, device=device, dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, ctx, D, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return bench(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))


def parse_cases(text: str) -> list[tuple[int, int]]:
    """"32x256,8x8192" -> [(32, 256), (8, 8192)]."""
    cases = [item.lower().split("x") for item in text.split(",") if item]
    if not cases or any(len(c) != 2 or not all(n.isdigit() for n in c) for c in cases):
        raise SystemExit(f"--decode-cases: expected BATCHxCONTEXT pairs such as 32x256,8x8192, got {text!r}")
    return [(int(b), int(c)) for b, c in cases]


def sdpa_prefill(N, L, Hq, Hkv, D, device):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q = torch.randn(N, Hq, L, D, device=device, dtype=torch.bfloat16)
    k = torch.randn(N, Hkv, L, D, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))


def main(args) -> int:
    assert torch.cuda.is_available(), "the attention benchmark needs a CUDA device"
    device = torch.device("cuda")
    Hq, Hkv, D = args.heads, args.kv_heads, args.head_dim
    flex_backend.DIRECT_PAGES = args.prefill_from == "pages"
    prefill_kernel.FA4_Q_TILES = args.fa4_q_tiles
    random.seed(0)
    rows = []
    mods = parse_mods(args.mask, args.score, Hq)
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | Hq={Hq} Hkv={Hkv} D={D} bf16 | µs (median) | "
          f"flex: mask {args.mask}, score {args.score}, 128-token pages prefill from the {args.prefill_from}; "
          f"SDPA: causal")
    head = "| case | floor | SDPA flash | " + " | ".join(f"flex p{p} | ratio p{p} | meta p{p}" for p in args.page_sizes) + " |"
    print(head)
    print("|" + "---|" * (3 + 3 * len(args.page_sizes)))
    def measured(r):  # each row printed once measured: a run cut by a time limit keeps the rows it made
        lens = [r["ctx"]] * r["B"]
        query_lens = [1] * r["B"] if r["kind"] == "decode" else lens
        for p in args.page_sizes:
            r[f"flex_p{p}"], r[f"meta_p{p}"] = flex_times(lens, query_lens, p, Hq, Hkv, D, device, mods)
        cells = [f"{r['kind']} {r['B']}x{r['ctx']}", f"{r['floor']:.0f}", f"{r['sdpa']:.0f}"]
        for p in args.page_sizes:
            cells += [f"{r[f'flex_p{p}']:.0f}", f"{r['sdpa'] / r[f'flex_p{p}']:.2f}x", f"{r[f'meta_p{p}']:.0f}"]
        print("| " + " | ".join(cells) + " |", flush=True)
        rows.append(r)

    bandwidth = hbm_bytes_per_s()
    for B, ctx in parse_cases(args.decode_cases) if args.decode_cases else DECODE:
        floor = B * ctx * Hkv * D * 2 * 2 / bandwidth * 1e6
        measured(dict(kind="decode", B=B, ctx=ctx, floor=floor, sdpa=sdpa_decode(B, ctx, Hq, Hkv, D, device)))
    for N, L in [] if args.decode_only else PREFILL:
        floor = 4 * N * Hq * D * L * L / 2 / BF16_FLOPS * 1e6
        measured(dict(kind="prefill", B=N, ctx=L, floor=floor, sdpa=sdpa_prefill(N, L, Hq, Hkv, D, device)))
    print(f"# ratio = SDPA time / flex time (>1: flex faster); compiled graphs: {compile_count()}")
    write_json(args.json, dict(device=torch.cuda.get_device_name(), torch=torch.__version__, mask=args.mask,
                               score=args.score, rows=rows))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
