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

from .policy import bucket, decode_buckets, tile_bucket


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


def dummy_seqs(runner, num_seqs: int, tokens_each: int, cached: int = 0, first: int = 0) -> list:
    """`num_seqs` requests computing `tokens_each` tokens after `cached` ones (the first numbered `first`)."""
    from ..engine.sequence import Sequence
    n = cached + tokens_each
    pages = -(-n // runner.block_size)
    seqs = []
    for i in range(first, first + num_seqs):
        seq = Sequence(request_id="warmup", index=0, token_ids=[0] * n, num_prompt_tokens=n, params=None)
        seq.num_computed_tokens = cached
        # dummies may share pages: a bucket can outnumber them
        seq.block_table = [(i * pages + j) % runner.num_blocks for j in range(pages)]
        seqs.append(seq)
    return seqs


def dummy_step(runner, num_seqs: int, tokens_each: int, cached: int = 0) -> None:
    """One step of `num_seqs` requests computing `tokens_each` tokens after `cached` ones."""
    from ..engine.scheduler import ScheduledBatch
    with torch.inference_mode():
        batch = ScheduledBatch(dummy_seqs(runner, num_seqs, tokens_each, cached), [tokens_each] * num_seqs)
        inputs = runner.prepare_step(batch, sampling=False)
        runner.forward_logits(inputs.input_ids, inputs.positions, inputs.meta)


def capture_mixed_graphs(runner) -> int:
    """Capture the graph of every step layout with prompt tokens that fits one (decode bucket or none,
    times prefill tile bucket), so that none is captured while requests wait; then run the logits
    GEMM at every row count such a step can sample (cuBLAS loads kernels on first use). Returns how
    many graphs were captured."""
    from ..attention.metadata import Q_TILE
    from ..engine.scheduler import ScheduledBatch
    graphs, cfg = runner.mixed_graphs, runner.config
    buckets = decode_buckets(cfg.max_num_seqs)
    top = min(graphs.max_tiles, max_prefill_tiles(cfg.max_num_batched_tokens, cfg.max_num_seqs))
    per_prompt = runner.max_model_len // Q_TILE  # whole tiles one dummy prompt can hold
    before = len(graphs.graphs)
    with torch.inference_mode():
        for tiles in [1 << i for i in range(top.bit_length())]:
            need = tiles // 2 + 1 if tiles > 1 else 1  # fewest tiles that pad to this bucket
            # as few prompts as possible, so that the most decode rows fit beside them
            lengths = [min(per_prompt, need - k) * Q_TILE for k in range(0, need, per_prompt)] if per_prompt else [2] * need
            for rows in [0] + buckets:
                num_decode = min(rows, cfg.max_num_seqs - len(lengths))  # every request needs a table row
                if num_decode < 0 or (rows and bucket(num_decode, buckets) != rows):
                    continue
                seqs = dummy_seqs(runner, num_decode, 1, cached=1)
                for n in lengths:
                    seqs += dummy_seqs(runner, 1, n, first=len(seqs))
                p = runner.pack_step(ScheduledBatch(seqs, [1] * num_decode + lengths))
                assert graphs.fits(p.layout) and p.layout.num_tiles == tiles, p.layout
                graphs.run(p.ids, p.positions, p.slots, p.tables, p.seq_lens, p.layout,
                           runner.attention_params(seqs, len(p.seq_lens)))
        hidden = torch.zeros(cfg.max_num_seqs, runner.model.spec.hidden_size, dtype=runner.dtype,
                             device=runner.device)
        for n in range(1, cfg.max_num_seqs + 1):
            runner.model.compute_logits(hidden[:n])
    return len(graphs.graphs) - before


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


def warm_up_unpadded(runner) -> float:
    """Steps of unpadded shapes (the flash backend): the compiled layer regions specialise a one-token
    step and compile once for any longer one; the paged flash kernel compiles (JIT) once per mask.
    Returns the seconds."""
    start = time.perf_counter()
    dummy_step(runner, 1, 1)              # T = 1
    dummy_step(runner, 2, 2)              # T >= 2, whole prompts (no paging)
    dummy_step(runner, 3, 1, cached=1)    # decode rows over a cached prefix: the paged kernel
    dummy_step(runner, 1, 5, cached=3)    # a chunk over a cached prefix
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return time.perf_counter() - start
