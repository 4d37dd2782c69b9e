"""Host time of PenaltyHistories.update for a step whose penalised sequences are all new (each brings its whole
prompt): the write issue 20's penalties run pays once per sequence (docs/benchmarks.md, session 19).

    python3 scripts/penalty_history_time.py [--rows 256 --prompt-len 256 --repeats 20]
"""
from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import numpy as np
import torch

from flexengine.engine.logits_adjust import PenaltyHistories
from flexengine.engine.sequence import PENDING


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    times = []
    for _ in range(args.repeats):
        seqs = [SimpleNamespace(seq_id=i, num_prompt_tokens=args.prompt_len,
                                token_ids=rng.integers(0, 128_000, args.prompt_len).tolist() + [PENDING])
                for i in range(args.rows)]
        histories = PenaltyHistories(args.rows, "cpu")
        start = time.perf_counter()
        histories.update(seqs, list(range(args.rows)), (None, torch.arange(args.rows)), args.rows)
        times.append(time.perf_counter() - start)
    print(f"PenaltyHistories.update, {args.rows} new sequences of {args.prompt_len + 1} tokens (the last PENDING): "
          f"median {np.median(times) * 1e3:.2f} ms, min {min(times) * 1e3:.2f}, max {max(times) * 1e3:.2f} "
          f"over {args.repeats} runs (torch {torch.__version__}, CPU)")


if __name__ == "__main__":
    main()
