"""Start-up warm-up: compile every step shape before the first request.

FlexAttention is compiled with static shapes and the engine pads its token buffer to whole prefill
tiles (policy.tile_bucket) and decode rows to the decode buckets. Prefill bucket b is warmed by one
step of b * 128 prompt tokens, in as few prompts as max_model_len allows; decode bucket b by one step
of b one-token requests. Dummy requests write pages no request owns yet (sharing them when there are
more dummies than pages); their per-request parameters are zeros of the dtypes the mods declare, so
requests meet the kernels compiled here. With CUDA graphs the capture compiles the decode buckets
instead.
"""
from __future__ import annotations

import logging
import time

import torch

from .policy import allow_recompiles, bucket, tile_bucket, tile_buckets

logger = logging.getLogger(__name__)

# Capture at start-up the plan graphs of steps past the whole graphs' tiles (mixed_graphs.py), one per (tile bucket,
# decode bucket) past 16 tiles (72 of 130 at the default budget), each after an eager run of its plan and its model.
# False: each is captured when a step first meets it, as any key the start-up did not capture (a one-time cost of
# that step). A knob for a same-box A/B of a fresh start (issue 24; decode_step_probe.py's plan_graphs_at_start=0).
CAPTURE_PLAN_GRAPHS = True


def compile_steps(runner) -> None:
    """Start-up's compile work, before the first request. Static shapes (flex): one step per prefill bucket,
    then, with CUDA graphs, each decode bucket's graph and the graph of every step layout with prompt tokens
    (without graphs, one step per decode bucket). Unpadded steps (flash): the layer regions, compiled once for
    every length. Sets runner.decode_graphs and runner.mixed_graphs; logs each part's seconds."""
    if not runner.static_shapes:
        logger.info("warm-up (compiled layers, %s kernels): %.1f s", runner.backend.name, warm_up_unpadded(runner))
        return
    allow_recompiles(shape_classes(runner))
    # Decode shapes are compiled by the graph capture; without graphs, by the warm-up.
    logger.info("warm-up (compiles every step shape): %.1f s", warm_up_steps(runner, decode=not runner.compiled))
    if not runner.compiled:
        return
    runner.decode_graphs = capture_decode_graphs(runner)
    runner.mixed_graphs = mixed_graph_runner(runner, runner.decode_graphs.pool)
    if runner.mixed_graphs.use_graphs:
        started = time.perf_counter()
        count = capture_mixed_graphs(runner)
        logger.info("captured %d CUDA graphs for steps with prompt tokens in %.1f s", count,
                    time.perf_counter() - started)


def progress(runner, items, desc: str):
    """`items` under a progress bar: a machine's first start compiles for minutes (vLLM shows its graph capture the
    same way). On a terminal only (tqdm's disable=None: logs, CI and pipes stay clean), and on the first
    tensor-parallel rank (the others compile the same shapes beside it)."""
    from tqdm.auto import tqdm
    driver = getattr(getattr(runner, "tp", None), "rank", 0) == 0
    return tqdm(list(items), desc=desc, unit="shape", dynamic_ncols=True, disable=None if driver else True)


def capture_decode_graphs(runner):
    from .cuda_graphs import DecodeGraphRunner
    graphs = DecodeGraphRunner(
        runner.forward_logits, runner.backend, runner.mods, max_num_seqs=runner.config.max_num_seqs,
        block_size=runner.block_size, num_blocks=runner.num_blocks + 1, table_width=runner.table_width,
        num_kv_heads=runner.num_kv_heads, params=runner.param_dtypes(),
        scratch_slot=runner.num_blocks * runner.block_size, device=runner.device)
    graphs.capture_all(lambda buckets: progress(runner, buckets, "Capturing decode CUDA graphs"))
    logger.info("captured %d decode CUDA graphs in %.1f s (batch: (s, new graphs) %s), %.1f MiB", len(graphs.graphs),
                graphs.capture_seconds, dict(sorted(graphs.bucket_seconds.items())), graphs.graph_bytes / 2 ** 20)
    return graphs


def mixed_graph_runner(runner, pool):
    """Graphs for steps with prompt tokens (mixed_graphs.py), captured by capture_mixed_graphs."""
    from .mixed_graphs import MixedGraphRunner
    return MixedGraphRunner(
        runner.run_model, runner.backend, runner.mods, rows=runner.config.max_num_seqs,
        table_width=runner.table_width, block_size=runner.block_size, num_blocks=runner.num_blocks + 1,
        params=runner.param_dtypes(), scratch_slot=runner.num_blocks * runner.block_size, device=runner.device,
        num_kv_heads=runner.num_kv_heads, workspace_pages=runner.backend.workspace_pages, pool=pool,
        max_tiles=runner.whole_graph_tiles, plan_tiles=max_prefill_tiles(runner.config.max_num_batched_tokens))


def max_prefill_tiles(max_num_batched_tokens: int) -> int:
    """Most prefill tiles one step can have: its tokens (at most the budget) in whole tiles, bucketed."""
    from ..attention.layout import Q_TILE
    return tile_bucket(-(-max_num_batched_tokens // Q_TILE))


def prefill_buckets(runner) -> list[int]:
    return tile_buckets(max_prefill_tiles(runner.config.max_num_batched_tokens))


def prompt_lengths(runner, tiles: int, beside: int = 0) -> list[int] | None:
    """Dummy prompts whose tokens, with `beside` decode tokens, fill a step of `tiles` (a bucket) as far
    as max_model_len and max_num_seqs allow, in as few prompts as possible; None when no step of
    those requests pads to that bucket."""
    from ..attention.layout import Q_TILE
    longest, room = max(2, runner.max_model_len), runner.config.max_num_seqs - beside
    tokens = min(tiles * Q_TILE - beside, longest * room)
    if room < 1 or tokens < 2 or tile_bucket(-(-(tokens + beside) // Q_TILE)) != tiles:
        return None
    lengths = [longest] * (tokens // longest) + ([tokens % longest] if tokens % longest else [])
    if lengths[-1] < 2:  # a one-token prompt would be a decode row
        lengths[-1], lengths[-2] = 2, lengths[-2] - 1
    return lengths


def shape_classes(runner) -> int:
    """Compiled flex graphs the engine needs: one per bucket (and the wide-q-block step) and per distinct (mask,
    score) pair."""
    buckets = len(prefill_buckets(runner)) + len(runner.decode_buckets)
    return (buckets + (wide_prefill_step(runner) is not None)) * len(set(runner.mods))


def wide_prefill_step(runner) -> tuple[int, int] | None:
    """(tokens, cached) of a one-request step that takes wide q blocks (compile.wide_q_tiles: the largest bucket,
    filled, over a long context), or None when no step can."""
    from ..attention.layout import Q_TILE
    from .policy import WIDE_Q_MIN_CONTEXT
    tokens = min(runner.max_prefill_tiles * Q_TILE, runner.config.max_num_batched_tokens)
    if getattr(runner.backend, "q_tiles", 1) == 1 or not tokens \
            or WIDE_Q_MIN_CONTEXT + tokens > runner.max_model_len:
        return None
    return tokens, WIDE_Q_MIN_CONTEXT


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


def dummy_prompts(runner, lengths: list[int], first: int = 0) -> list:
    """One dummy request per prompt length, nothing cached, numbered from `first`."""
    seqs = []
    for n in lengths:
        seqs += dummy_seqs(runner, 1, n, first=first + len(seqs))
    return seqs


def dummy_step(runner, num_seqs: int, tokens_each: int, cached: int = 0) -> None:
    """One step of `num_seqs` requests computing `tokens_each` tokens after `cached` ones."""
    run_dummy(runner, dummy_seqs(runner, num_seqs, tokens_each, cached), [tokens_each] * num_seqs)


def run_dummy(runner, seqs: list, num_new_tokens: list[int]) -> None:
    from ..engine.scheduler import ScheduledBatch
    with torch.inference_mode():
        inputs = runner.prepare_step(ScheduledBatch(seqs, num_new_tokens))
        hidden = runner.run_model(inputs.input_ids, inputs.positions, inputs.meta)
        # logits of the rows a step samples, as execute computes them: every row's (all 8,192 of a full
        # step, gathered over the vocabulary under TP) was 4 GiB that the KV-cache sizing had not left free
        runner.model.compute_logits(hidden[inputs.sample_rows])


def capture_mixed_graphs(runner) -> int:
    """Capture the graph of every step layout with prompt tokens (mixed decode bucket or none, times prefill tile
    bucket): the whole step's up to max_tiles, the plan and metadata's past it; so that none is captured while
    requests wait. Then run the logits GEMM at every row count such a step can sample (cuBLAS loads kernels on
    first use). Returns how many graphs were captured."""
    from ..engine.scheduler import ScheduledBatch
    graphs, cfg = runner.mixed_graphs, runner.config
    buckets = runner.mixed_decode_buckets  # (what layout_padding pads a mixed step's decode rows to)
    top = min(graphs.plan_tiles, max_prefill_tiles(cfg.max_num_batched_tokens))
    before = len(graphs.graphs) + len(graphs.plan_graphs)
    layouts = []  # (tiles, decode rows, prompt lengths) of every step layout a graph serves
    for tiles in tile_buckets(top):
        for rows in [0] + buckets:
            # the bucket's decode rows (as few real ones as pad to it) and prompts filling its tiles
            num_decode = next((n for n in range(1, rows + 1) if bucket(n, buckets) == rows), 0) if rows else 0
            lengths = prompt_lengths(runner, tiles, beside=num_decode)
            if lengths is not None and (CAPTURE_PLAN_GRAPHS or tiles <= graphs.max_tiles):
                layouts.append((tiles, num_decode, lengths))
    with torch.inference_mode():
        for tiles, num_decode, lengths in progress(runner, layouts, "Capturing prompt-step CUDA graphs"):
            seqs = dummy_seqs(runner, num_decode, 1, cached=1)
            seqs += dummy_prompts(runner, lengths, first=len(seqs))
            p = runner.pack_lengths(ScheduledBatch(seqs, [1] * num_decode + lengths))
            key = runner.graph_key(p)
            assert key is not None and key.num_tiles == tiles, (key, tiles)
            runner.run_mixed_graph(p, key, seqs)
        hidden = torch.zeros(cfg.max_num_seqs, runner.model.spec.hidden_size, dtype=runner.dtype,
                             device=runner.device)
        for n in range(1, cfg.max_num_seqs + 1):
            runner.model.compute_logits(hidden[:n])
    return len(graphs.graphs) + len(graphs.plan_graphs) - before


def warm_up_sampling(runner) -> None:
    """Compile what scores and samples logits before a request asks: the prompt-logprob scoring
    (layers/sampler.token_logprobs on logits in the model dtype; one graph serves every row count, as
    compute_logprobs gives it two rows for one) and the sampler's temperature draw (Sampler.warm_up)."""
    from ..layers.sampler import compute_logprobs
    with torch.inference_mode():  # the logits' width: the vocabulary as the model's lm_head pads it
        width = runner.model.compute_logits(torch.zeros(1, runner.model.spec.hidden_size, dtype=runner.dtype,
                                                        device=runner.device)).shape[-1]
        compute_logprobs(torch.zeros(2, width, dtype=runner.dtype, device=runner.device),
                         torch.zeros(2, dtype=torch.long, device=runner.device), 1, runner.compiled)
    runner.sampler.warm_up(width, runner.device)


def warm_up_steps(runner, decode: bool = False) -> float:
    """Run one dummy step per prefill bucket (and per decode bucket if `decode`), and compile the logprob
    scoring and the sampler; returns the seconds."""
    start = time.perf_counter()
    warm_up_sampling(runner)
    steps = []  # one dummy step per shape: (its requests, their new tokens)
    for b in prefill_buckets(runner):
        lengths = prompt_lengths(runner, b)
        if lengths is not None:  # (None: no step can pad to this bucket)
            steps.append((dummy_prompts(runner, lengths), lengths))
    wide = wide_prefill_step(runner)
    if wide is not None:
        steps.append((dummy_seqs(runner, 1, *wide), [wide[0]]))
    if decode:
        steps += [(dummy_seqs(runner, b, 1), [1] * b) for b in runner.decode_buckets]
    for seqs, num_new_tokens in progress(runner, steps, "Compiling step shapes"):
        run_dummy(runner, seqs, num_new_tokens)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return time.perf_counter() - start


def warm_up_unpadded(runner) -> float:
    """Steps of unpadded shapes (the flash backend): the compiled layer regions specialise a one-token
    step and compile once for any longer one; the paged flash kernel compiles (JIT) once per mask.
    Returns the seconds."""
    start = time.perf_counter()
    warm_up_sampling(runner)
    dummy_step(runner, 1, 1)              # T = 1
    dummy_step(runner, 2, 2)              # T >= 2, whole prompts (no paging)
    dummy_step(runner, 3, 1, cached=1)    # decode rows over a cached prefix: the paged kernel
    dummy_step(runner, 1, 5, cached=3)    # a chunk over a cached prefix
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return time.perf_counter() - start
