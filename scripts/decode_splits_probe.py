"""Small-batch decode with split-KV inside the kernel, as split rows, and with no split at all (issue 16).

    python3 scripts/decode_splits_probe.py --model /dev/shm/llama1b [--contexts 128,1024,4096 --batches 1,8]

`choose_decode_splits` gives each decode graph bucket enough split-KV rows for two programs per SM (32 splits at
batch 1 on the H100 with 8 KV heads), whatever the context: a 384-token context is then 3 pages in 32 splits, 29
of them empty, plus a query gather and a merge launch per layer. With one split the step has neither, but a
long context is one program per KV head. Split inside the kernel (FLEXENGINE_SPLIT_KV=kernel; the default, auto,
takes it for a lone request), each request is one row whose pages flex's own SPLIT_KV programs share: no gather,
no merge, but every page's mask is evaluated. This builds the engine three times in one process (kernel splits,
split rows, splits forced to 1), measures decode ms/token at each batch and context (`bench latency`'s method),
and prints them with their ratios: the data for choosing how and how much to split. A probe for a decision.
"""
from __future__ import annotations

import argparse
import gc
import os

import torch

from flexengine import LLM
from flexengine.attention import layout, paged_attention
from flexengine.benchmarks.latency import measure_decode
from flexengine.compile import cuda_graphs


def measure(args, label: str) -> dict:
    llm = LLM(args.model, dtype="bfloat16", max_num_seqs=max(args.batches), max_model_len=args.max_model_len)
    graphs = llm.llm_engine.runner.decode_graphs
    print(f"# {label}: splits per decode bucket {graphs.splits if graphs is not None else 'no decode graphs'}",
          flush=True)
    rows = {}
    for batch in args.batches:
        for ctx in args.contexts:
            m = measure_decode(llm, batch, ctx, args.output_len, num_iters=3, num_warmup=1, temperature=1.0, seed=ctx)
            rows[batch, ctx] = m["ms_per_token"]
            print(f"{label} batch {batch} context {ctx}: {m['ms_per_token']:.3f} ms/token", flush=True)
    llm.llm_engine.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    torch._dynamo.reset()  # the second engine's compiles count against no limit the first one filled
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--contexts", default="128,1024,4096", help="prompt tokens (the decode's context grows from there)")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=8192)
    args = p.parse_args()
    args.contexts = [int(x) for x in args.contexts.split(",")]
    args.batches = [int(x) for x in args.batches.split(",")]
    runs = {}
    for mode in ("kernel", "rows"):
        os.environ["FLEXENGINE_SPLIT_KV"] = mode
        runs[mode] = measure(args, f"split {mode}")
    one = lambda num_decode, num_kv_heads, device: 1  # noqa: E731
    layout.choose_decode_splits = cuda_graphs.choose_decode_splits = paged_attention.choose_decode_splits = one
    runs["one"] = measure(args, "one split")
    print("\n| batch | context | kernel splits ms/token | split rows ms/token | one split ms/token | rows / kernel | "
          "one / kernel |\n|---|---|---|---|---|---|---|")
    for key, ms in runs["kernel"].items():
        rows, one_ms = runs["rows"][key], runs["one"][key]
        print(f"| {key[0]} | {key[1]} | {ms:.3f} | {rows:.3f} | {one_ms:.3f} | {rows / ms:.2f} | {one_ms / ms:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
