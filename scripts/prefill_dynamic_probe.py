"""The Triton prefill kernel compiled per bucket (static shapes) against one compile whose tile count is symbolic
(attention/backends/flex_kernels.py's PREFILL_DYNAMIC): the prefill call's µs at the engine's tile buckets, over one
pool of fixed size as in the engine (its size a constant of both), and the graphs each way compiles.

    python3 scripts/prefill_dynamic_probe.py --cases 1x1024,8x1024,1x8192+57344

A case NxL+C is N prompts of L new tokens after C cached ones; Nx1+C are N decode rows (past 32 rows on flex's decode
template per bucket; the symbolic way runs every unsplit decode row with query heads as rows, compiled once for a
symbolic row count: flex_kernels.DECODE_DYNAMIC; list the largest first, as the engine's capture runs them:
256x1+4096,192x1+4096,128x1+4096,96x1+4096,64x1+4096). The way `heads` runs decode rows with query heads as rows at
every row count, compiled per bucket. Each call is captured in a CUDA graph and timed by its replay
(triton.testing.do_bench, median µs); the ways alternate round by round in one process.
"""
from __future__ import annotations

import argparse
import json
import random

import torch

from flexengine.attention.backends import flex as flex_backend, flex_kernels
from flexengine.attention.layout import plan_layout
from flexengine.attention.metadata import build_metadata
from flexengine.benchmarks.attention import bench, parse_mods
from flexengine.compile.policy import compile_count

PAGE = 128
# each way's flex_kernels flags: per bucket; query heads as rows at every decode row count, per bucket; one compile
# for a symbolic tile or row count
HEADS = flex_kernels.DECODE_HEADS_AS_ROWS
WAYS = {"static": {"PREFILL_DYNAMIC": False, "DECODE_DYNAMIC": False, "DECODE_HEADS_AS_ROWS": HEADS},
        "heads": {"PREFILL_DYNAMIC": False, "DECODE_DYNAMIC": False, "DECODE_HEADS_AS_ROWS": 1 << 20},
        "symbolic": {"PREFILL_DYNAMIC": True, "DECODE_DYNAMIC": True, "DECODE_HEADS_AS_ROWS": HEADS}}


def parse_cases(text: str) -> list[tuple[int, int, int]]:
    """"8x1024,1x8192+57344" -> [(8, 1024, 0), (1, 8192, 57344)]."""
    out = []
    for item in text.split(","):
        shape, _, cached = item.partition("+")
        n, _, length = shape.lower().partition("x")
        out.append((int(n), int(length), int(cached or 0)))
    return out


def captured_call(backend, case, kc, vc, mods, width, rng):
    """(a CUDA graph of the case's prefill call, the case's tile count, the inputs it reads: kept alive while the
    graph is replayed)."""
    n, length, cached = case
    seq_lens, query_lens = [cached + length] * n, [length] * n
    need = -(-(cached + length) // PAGE)
    pages = rng.sample(range(kc.shape[0]), n * need)
    tables = torch.tensor([pages[i * need:(i + 1) * need] + [0] * (width - need) for i in range(n)],
                          dtype=torch.int32, device=kc.device)
    layout = plan_layout(query_lens, seq_lens, block_size=PAGE)
    meta = build_metadata(tables, torch.tensor(seq_lens, dtype=torch.int32, device=kc.device),
                          torch.empty(0, dtype=torch.long, device=kc.device), layout, PAGE, kc.shape[0])
    meta.backend = backend
    backend.prepare(meta, [mods])
    q = torch.randn(sum(query_lens), kc.shape[2] * 4, kc.shape[3], device=kc.device, dtype=kc.dtype)
    run = lambda: backend.forward(q, kc, vc, meta, *mods, kc.shape[3] ** -0.5)  # noqa: E731
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph, layout.num_tiles, (q, meta)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="1x128,1x256,1x512,1x1024,2x1024,1x3072,4x1024,1x4096,6x1024,8x1024,1x8192,"
                   "1x8192+57344", help="prefill calls NxL+C (default: every bucket up to 64 tiles, and a long chunk)")
    p.add_argument("--kv-heads", type=int, default=8, help="key/value heads (query heads: 4x; Llama-3.2-1B's shape)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--pool-pages", type=int, default=31289, help="the pool's pages (the engine's at 131,072 tokens)")
    p.add_argument("--mask", default="causal")
    p.add_argument("--score", default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ways", default="static,symbolic",
                   help=f"which compiles to run, comma-separated, the first the baseline: {', '.join(WAYS)}")
    p.add_argument("--heads-tiles", type=json.loads, default=None,
                   help='flex_kernels.HEADS_AS_ROWS_TILES for every way, e.g. \'{"BLOCK_N": 64, "num_warps": 2}\'')
    args = p.parse_args()
    if args.heads_tiles is not None:
        flex_kernels.HEADS_AS_ROWS_TILES = args.heads_tiles
    device = torch.device("cuda")
    cases = parse_cases(args.cases)
    Hkv, D = args.kv_heads, args.head_dim
    mods = parse_mods(args.mask, args.score, 4 * Hkv)
    kc = torch.randn(args.pool_pages, PAGE, Hkv, D, device=device, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    width = max(-(-(c + n) // PAGE) for _, n, c in cases)
    ways = args.ways.split(",")
    if not set(ways) <= set(WAYS):
        raise SystemExit(f"--ways: some of {', '.join(WAYS)}, comma-separated, not {args.ways!r}")
    graphs, compiles = {w: [] for w in ways}, {}
    for way in ways:  # each way's compiles first (each call checked by a sync), then the timed rounds
        for name, value in WAYS[way].items():
            setattr(flex_kernels, name, value)
        before = compile_count()
        backend = flex_backend.FlexBackend(compile=True)
        # (an engine's backend, for symbolic_flex; its size bounds the pages a tile lists)
        backend.reserve_workspace(width * max(n for n, _, _ in cases), PAGE, Hkv, D, kc.dtype, device)
        rng = random.Random(0)
        for case in cases:
            print(f"{way} {case}", flush=True)
            graphs[way].append(captured_call(backend, case, kc, vc, mods, width, rng))
            graphs[way][-1][0].replay()
            torch.cuda.synchronize()
        compiles[way] = compile_count() - before
    times = {(w, i): [] for w in ways for i in range(len(cases))}
    for _ in range(args.rounds):
        for way in ways:
            for i, (graph, _, _) in enumerate(graphs[way]):
                times[way, i].append(bench(graph.replay))
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | Hq={4 * Hkv} Hkv={Hkv} D={D} bf16 | pool "
          f"{args.pool_pages} pages of {PAGE} | mask {args.mask}, score {args.score} | median µs per round, "
          f"{args.rounds} rounds alternating")
    print("# graphs compiled: " + ", ".join(f"{w} {compiles[w]}" for w in ways))
    others = ways[1:]
    print("| case | tiles | " + " | ".join(f"{w}, µs" for w in ways) + "".join(f" | {w} / {ways[0]}" for w in others)
          + " |")
    print("|---|---|" + "---|" * (len(ways) + len(others)))
    for i, (n, length, cached) in enumerate(cases):
        name = f"{n}x{length}" + (f"+{cached}" if cached else "")
        cells = [" / ".join(f"{t:.0f}" for t in times[w, i]) for w in ways]
        cells += [f"{min(times[w, i]) / min(times[ways[0], i]):.3f}" for w in others]
        print(f"| {name} | {graphs[ways[0]][i][1]} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
