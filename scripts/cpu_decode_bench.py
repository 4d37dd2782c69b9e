"""Greedy decode on the CPU: flexengine against transformers `generate`, in one process (issue 26).

    python scripts/cpu_decode_bench.py --model DIR [--batch-sizes 1 8] [--input-len 32] [--output-len 64]
                                       [--mask causal|sliding_window:W] [--attention-backend flex]

DIR: e.g. `flexengine make-model --preset smollm2-135m --dtype float32 --out DIR`. Tokens/s counts generated
tokens over the wall time of the whole call (prefill included, as a user sees it); each row is the median
of --iters runs after one warm-up run. transformers runs batch 1 only (its `generate` at batch 8 pads).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def flexengine_row(args, batch: int) -> float:
    from flexengine import LLM, SamplingParams, masks
    from flexengine.benchmarks.common import random_prompts
    name, _, arg = args.mask.partition(":")
    mask = masks.sliding_window(int(arg)) if name == "sliding_window" else name
    llm = LLM(args.model, dtype="float32", mask_mod=mask, attention_backend=args.attention_backend,
              max_model_len=args.input_len + args.output_len + 8)
    vocab = llm.llm_engine.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    runs = []
    for i in range(args.iters + 1):
        prompts = [{"prompt_token_ids": p} for p in random_prompts(batch, args.input_len, vocab, seed=100 + i)]
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        runs.append(batch * args.output_len / (time.perf_counter() - start))
    return statistics.median(runs[1:])


def transformers_row(args) -> float:
    from transformers import AutoModelForCausalLM
    from flexengine.benchmarks.common import random_prompts
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa").eval()
    runs = []
    for i in range(args.iters + 1):
        ids = torch.tensor(random_prompts(1, args.input_len, model.config.vocab_size, seed=100 + i))
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.output_len,
                                 min_new_tokens=args.output_len, do_sample=False, pad_token_id=0)
        assert out.shape[1] - ids.shape[1] == args.output_len
        runs.append(args.output_len / (time.perf_counter() - start))
    return statistics.median(runs[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--mask", default="causal", help="causal or sliding_window:W (flexengine rows)")
    p.add_argument("--attention-backend", default=None, help="flex | reference | auto (default: the engine's)")
    args = p.parse_args()
    print(f"# CPU: {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads | "
          f"{args.model} float32 | {args.input_len} in, {args.output_len} out, greedy | median of {args.iters}")
    tf = transformers_row(args)
    print("| engine | batch | output tok/s | / transformers batch 1 |\n|---|---|---|---|")
    print(f"| transformers generate (sdpa) | 1 | {tf:.1f} | 1.00x |")
    for b in args.batch_sizes:
        fe = flexengine_row(args, b)
        print(f"| flexengine ({args.attention_backend or 'auto'}, mask {args.mask}) | {b} | {fe:.1f} | {fe / tf:.2f}x |")


if __name__ == "__main__":
    main()
