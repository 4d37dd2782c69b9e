"""Repro helper for the GPU box: one engine config per process; prints the innermost frames on failure."""
import sys
import time
import traceback

import torch

from flexengine import LLM, SamplingParams

block, eager, n, out_len = int(sys.argv[1]), sys.argv[2] == "eager", int(sys.argv[3]), int(sys.argv[4])
util = float(sys.argv[5]) if len(sys.argv) > 5 else 0.9
g = torch.Generator().manual_seed(0)
prompts = [{"prompt_token_ids": torch.randint(0, 128000, (256,), generator=g).tolist()} for _ in range(n)]
try:
    t = time.time()
    llm = LLM("/tmp/llama1b", dtype="bfloat16", block_size=block, enforce_eager=eager, gpu_memory_utilization=util)
    r = llm.llm_engine.runner
    print(f"block={block} eager={eager} blocks={r.num_blocks} init={time.time() - t:.1f}s", flush=True)
    t = time.time()
    outs = llm.generate(prompts, SamplingParams(max_tokens=out_len, ignore_eos=True), use_tqdm=False)
    torch.cuda.synchronize()
    dt = time.time() - t
    print(f"  OK {n}x256 -> {out_len}: {dt:.2f}s, {n * out_len / dt:.0f} out tok/s", flush=True)
except Exception:
    lines = traceback.format_exc().splitlines()
    print("  FAILED:", *[l for l in lines if "flexengine" in l or "compile/" in l or "Error" in l][-12:], sep="\n  ")
