"""Start-up warm-up: compile every prefill shape class before the first request.

FlexAttention is compiled with static shapes and the engine pads prefill tiles to powers of two
(decode rows are compiled by the CUDA-graph capture, bucket by bucket). Bucket b is warmed by one
step of b two-token requests, one tile each, on pages no request owns yet.
"""
from __future__ import annotations

import time

import torch

from .policy import tile_bucket


def max_prefill_tiles(max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """Most tiles one step can need: a tile per prefilling request plus one per 128 tokens."""
    return tile_bucket(min(max_num_seqs, max_num_batched_tokens // 2) + -(-max_num_batched_tokens // 128))


def warm_up_steps(runner) -> float:
    """Run one dummy step per prefill tile bucket; returns the seconds it took."""
    from ..engine.scheduler import ScheduledBatch
    from ..engine.sequence import Sequence
    cfg = runner.config
    start = time.perf_counter()
    b = 1
    while b <= max_prefill_tiles(cfg.max_num_batched_tokens, cfg.max_num_seqs) and b <= runner.num_blocks:
        seqs = []
        for i in range(b):
            seq = Sequence(request_id="warmup", index=0, token_ids=[0, 0], num_prompt_tokens=2, params=None)
            seq.block_table = [i]
            seqs.append(seq)
        with torch.inference_mode():
            inputs = runner.prepare_step(ScheduledBatch(seqs, [2] * b), sampling=False)
            runner.forward_logits(inputs.input_ids, inputs.positions, inputs.meta)
        b *= 2
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return time.perf_counter() - start
