"""How long xgrammar takes to fill and advance a step's token masks on this host (issue 20: JSON mode's host time).

    python3 scripts/grammar_fill_probe.py --model /dev/shm/llama1b [--rows 256]

Builds the engine's grammar compiler for the checkpoint's tokenizer, brings `rows` matchers of bench throughput's
schema into mid-output states (random allowed tokens), then times per step (median µs): the batched fill on 1..N
threads, the fill row by row, the batched accept; each right after a torch CPU op (its OpenMP workers may still
spin while xgrammar's threads run) and after a pause.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from transformers import AutoTokenizer

from flexengine import StructuredOutputsParams
from flexengine.benchmarks.throughput import bench_schema
from flexengine.engine.structured_outputs import Grammars, import_xgrammar


def median_us(fn, before, repeats: int = 30) -> float:
    times = []
    for _ in range(repeats):
        before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--steps", type=int, default=40, help="random allowed tokens each matcher takes first")
    args = p.parse_args()
    xgr = import_xgrammar()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    grammars = Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    compiled = grammars.compile(StructuredOutputsParams(json=bench_schema(0)))
    states = [grammars.matcher(compiled) for _ in range(args.rows)]
    matchers, width, vocab = [s.matcher for s in states], states[0].width, states[0].vocab_size
    bitmask = torch.empty((args.rows, width), dtype=torch.int32)
    rng = np.random.default_rng(0)

    def allowed(row: int) -> np.ndarray:
        bits = np.unpackbits(bitmask[row].numpy().view(np.uint8), bitorder="little")[:vocab]
        return np.nonzero(bits)[0]

    def next_tokens() -> list[int]:
        grammars.batch.batch_fill_next_token_bitmask(matchers, bitmask)
        return [int(rng.choice(allowed(i))) for i in range(args.rows)]

    for _ in range(args.steps):
        grammars.batch.batch_accept_token(matchers, next_tokens())
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    waits = {"after a torch CPU op": lambda: a @ b, "after a 2 ms pause": lambda: time.sleep(0.002)}
    print(f"# {args.rows} rows, tokenizer vocabulary {vocab} ({width} words), torch threads {torch.get_num_threads()}")
    print("| what | " + " | ".join(waits) + " |")
    print("|---|" + "---|" * len(waits))
    for threads in (1, 2, 4, 8, "auto"):
        batch = xgr.BatchGrammarMatcher(threads)
        print(f"| batch fill, max_threads {threads} | " + " | ".join(
            f"{median_us(lambda: batch.batch_fill_next_token_bitmask(matchers, bitmask), w):.0f}" for w in waits.values())
            + " |")
    print("| fill row by row | " + " | ".join(f"{median_us(lambda: [m.fill_next_token_bitmask(bitmask, i) for i, m in enumerate(matchers)], w):.0f}"
                                             for w in waits.values()) + " |")
    tokens = next_tokens()

    def accept_and_back():  # the same tokens each repeat: accept, then roll the matchers back
        grammars.batch.batch_accept_token(matchers, tokens)

    for name, w in waits.items():
        times = []
        for _ in range(30):
            w()
            start = time.perf_counter()
            accept_and_back()
            times.append(time.perf_counter() - start)
            for m in matchers:
                m.rollback(1)
        print(f"batch accept, {name}: {np.median(times) * 1e6:.0f} us")


if __name__ == "__main__":
    main()
