"""Start-up warm-up: compile every step shape before the first request.

FlexAttention is compiled with static shapes and the engine pads prefill tiles to powers of two and
decode rows to the decode buckets. Prefill bucket b is warmed by one step of b two-token requests,
one tile each; decode bucket b by one step of b one-token requests. Dummy requests write pages no
request owns yet (sharing them when there are more dummies than pages); their per-request parameters
are zeros of the dtypes the mods declare, so requests meet the kernels compiled here. With CUDA graphs
the capture compiles the decode buckets instead.
"""
from __future__ import annotations

import time

import torch

from .policy import decode_buckets, tile_bucket


def max_prefill_tiles(max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """Most tiles one step can need: a tile per prefilling request plus one per 128 tokens."""
    return tile_bucket(min(max_num_seqs, max_num_batched_tokens // 2) + -(-max_num_batched_tokens // 128))


def prefill_buckets(runner) -> list[int]:
    cfg = runner.config
    top = max_prefill_tiles(cfg.max_num_batched_tokens, cfg.max_num_seqs)
    return [1 << i for i in range(top.bit_length()) if 1 << i <= top]


def shape_classes(runner) -> int:
    """Compiled flex graphs the engine needs: one per bucket and per distinct (mask, score) pair."""
    return (len(prefill_buckets(runner)) + len(decode_buckets(runner.config.max_num_seqs))) * len(set(runner.mods))


def dummy_step(runner, num_seqs: int, tokens_each: int) -> None:
    from ..engine.scheduler import ScheduledBatch
    from ..engine.sequence import Sequence
    seqs = []
    for i in range(num_seqs):
        seq = Sequence(request_id="warmup", index=0, token_ids=[0] * tokens_each, num_prompt_tokens=tokens_each,
                       params=None)
        seq.block_table = [i % runner.num_blocks]  # dummies may share pages: a bucket can outnumber them
        seqs.append(seq)
    with torch.inference_mode():
        inputs = runner.prepare_step(ScheduledBatch(seqs, [tokens_each] * num_seqs), sampling=False)
        runner.forward_logits(inputs.input_ids, inputs.positions, inputs.meta)


def warm_up_steps(runner, decode: bool = False) -> float:
    """Run one dummy step per prefill bucket (and per decode bucket if `decode`); returns the seconds."""
    start = time.perf_counter()
    for b in prefill_buckets(runner):
        dummy_step(runner, b, 2)
    if decode:
        for b in decode_buckets(runner.config.max_num_seqs):
            dummy_step(runner, b, 1)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return time.perf_counter() - start
