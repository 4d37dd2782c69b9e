"""Host time of each step's inputs and attention metadata, as the engine builds them (issue 15, item 3).

    python3 scripts/step_host_time.py --model /dev/shm/llama1b [--num-prompts 256 --input-len 256 --output-len 32]

Runs an offline workload through `LLM.generate` and times, per step, the host functions that turn the
scheduled batch into device inputs (medians and p90 over the steps of each kind, µs):
- decode steps from a CUDA graph: `decode_from_graphs`, the whole host side of one (the page map, page
  lists and BlockMasks are built inside the graph). Of it: `DecodeTracker.next_step` (is the batch the
  last one moved on?), then either `run_decode_graph` (ids, positions, slots, lengths, tables packed into one
  copy that the graph unpacks, then the replay) or, in the steady state, `DecodeGraphRunner.run_moved_on`
  (the ids and new pages; the graph moves its buffers on, then the replay);
- steps with prompt tokens: `pack_lengths` (ids, each request's lengths, the block tables), then from a mixed
  graph `graph_key` and `MixedGraphRunner.run` (one staged copy of ids, lengths and tables, then the replay: the
  layout, positions, slots and metadata are planned inside the graph, attention/device_plan.py; its copies and its
  replays have rows of their own);
- `ModelRunner.feed`, every step's: which input rows take a pending sample of the step in flight (async scheduling;
  a decode step whose rows the graph gathers, or the same batch moved on, needs none);
  (past 16 prefill tiles the graph holds the plan and metadata alone, and the model runs eagerly after it);
- or, where no graph serves (warm-up, 16-token pages over a long context): `plan_step` (positions, slots and
  `plan_layout` on the host) and `prepare_step`, whose metadata is built by eager launches.
The model's own launches are not counted (they are the graph replay, or the eager layers); on CUDA a row times
`CUDAGraph.replay` itself, every graph's launch, the part of each replayed step no host packing can remove.

`--workload json|penalties` runs issue 20's workloads instead of plain sampling (every request under
`bench_schema(0)`, or with the penalties and logit_bias `bench throughput --penalties` uses) and also times the
whole host step (`LLMEngine._step`), its wait for the device (`InFlightStep.wait`), the grammar's
`fill_token_mask` and `accept_tokens`, `LogitsAdjuster.__call__`, the sampler's launches and the scheduler, and
outside the step each request's admission (`add_request`) and each step's outputs. The total column adds up. Per step, the
wall time against the host's busy time (`_step` less the wait) says whether the host or the device bounds it.
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import pstats
import time

import numpy as np
import torch

from flexengine import LLM, SamplingParams
from flexengine.benchmarks.common import random_prompts
from flexengine.compile import mixed_graphs
from flexengine.engine import in_flight, llm_engine, sampling_inputs, step_inputs
from flexengine.engine.logits_adjust import LogitsAdjuster
from flexengine.layers.sampler import Sampler


def timed(record: list, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record.append((time.perf_counter() - start) * 1e6)
    return wrapper


def sampling_params(workload: str, output_len: int, vocab: int) -> SamplingParams:
    if workload == "json":
        from flexengine import StructuredOutputsParams
        from flexengine.benchmarks.throughput import bench_schema
        return SamplingParams(max_tokens=output_len, temperature=1.0,
                              structured_outputs=StructuredOutputsParams(json=bench_schema(0)))
    if workload == "penalties":
        from flexengine.benchmarks.throughput import bench_penalties  # bench throughput --penalties' settings
        return bench_penalties(vocab, 0, output_len, 1.0)
    assert workload == "plain", f"unknown workload {workload!r} (plain, json, penalties)"
    return SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the engine's tiny random model (a CPU dry run)")
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's (a longer start-up)")
    p.add_argument("--workload", default="plain",
                   help="comma-separated, one engine for all: plain (greedy, as before), json (needs xgrammar), penalties")
    p.add_argument("--cprofile", default=None, metavar="FILE",
                   help="also write cProfile's statistics of the last workload's generate to FILE (pstats), and print "
                        "its 25 functions of most own time (its table's times read high: --workload plain,plain gives "
                        "a clean table first)")
    args = p.parse_args()
    llm = LLM(args.model, dtype="bfloat16" if torch.cuda.is_available() else "float32",
              max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=args.num_kv_blocks,
              max_model_len=args.max_model_len)
    runner = llm.llm_engine.runner
    if torch.cuda.is_available() and runner.mixed_graphs is not None:  # what the graphs hold beside the cache, weights
        cache = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in runner.kv_cache)
        graphs = runner.mixed_graphs
        print(f"GPU memory after start-up: {torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated, of which the KV "
              f"cache {cache / 2**30:.2f} GiB; mixed graphs: {len(graphs.graphs)} whole, "
              f"{len(getattr(graphs, 'plan_graphs', ()))} of a plan alone", flush=True)
    times = collections.defaultdict(list)
    # (the table lists them in this order: each step kind, then what it is made of)
    runner.decode_from_graphs = timed(times["decode_from_graphs (a whole decode step)"], runner.decode_from_graphs)
    runner.decode_tracker.next_step = timed(times["  of which DecodeTracker.next_step"], runner.decode_tracker.next_step)
    runner.run_decode_graph = timed(times["  of which run_decode_graph (a whole batch packed, staged, replayed)"],
                                    runner.run_decode_graph)
    if runner.decode_graphs is not None:
        graphs = runner.decode_graphs
        graphs.run = timed(times["    of which DecodeGraphRunner.run (staged, replayed)"], graphs.run)
        graphs.run_moved_on = timed(times["  of which DecodeGraphRunner.run_moved_on"], graphs.run_moved_on)
    in_mixed = [False]  # (inside MixedGraphRunner.run: its replays and copies get rows of their own)
    if torch.cuda.is_available():  # every graph's launch alone: the floor of a replayed step's host time
        replay = torch.cuda.CUDAGraph.replay
        decode_replays = times["  CUDAGraph.replay (a decode graph's launch, inside the rows above)"]

        def timed_replay(graph):
            start = time.perf_counter()
            replay(graph)
            (times["  of which CUDAGraph.replay (a mixed or plan graph's launch)"] if in_mixed[0] else
             decode_replays).append((time.perf_counter() - start) * 1e6)
        torch.cuda.CUDAGraph.replay = timed_replay
    runner.pack_lengths = timed(times["pack_lengths (steps with prompt tokens: ids, lengths, tables)"],
                                runner.pack_lengths)
    if runner.mixed_graphs is not None:
        runner.graph_key = timed(times["then graph_key (the mixed graph's key, or none)"], runner.graph_key)
        mixed = runner.mixed_graphs
        mixed_run = timed(times["then MixedGraphRunner.run (layout planned in the graph)"], mixed.run)

        def flagged_run(*a, **k):
            in_mixed[0] = True
            try:
                return mixed_run(*a, **k)
            finally:
                in_mixed[0] = False
        mixed.run = flagged_run
        mixed_graphs.copy_into = timed(times["  of which copy_into (its staged host-to-device copies)"],
                                       mixed_graphs.copy_into)
        runner.feed = timed(times["ModelRunner.feed (which rows wait on the step in flight; every kind of step)"],
                            runner.feed)
        if hasattr(mixed, "planned_step"):  # (a base from before session 34 has no plan graphs)
            mixed.planned_step = timed(times["  of which planned_step (past 16 tiles: the plan and metadata's graph)"],
                                       mixed.planned_step)
            mixed.run_model = timed(times["  of which the model's eager launches (past 16 tiles)"], mixed.run_model)
    runner.plan_step = timed(times["or plan_step (positions, slots, layout on the host)"], runner.plan_step)
    step_inputs.plan_layout = timed(times["  of which plan_layout"], step_inputs.plan_layout)
    runner.prepare_step = timed(times["  then prepare_step (eager metadata)"], runner.prepare_step)
    engine = llm.llm_engine
    steps, waits = times["LLMEngine._step (a whole host step)"], times["  of which InFlightStep.wait (for the device)"]
    engine._step = timed(steps, engine._step)
    in_flight.InFlightStep.wait = timed(waits, in_flight.InFlightStep.wait)
    Sampler.__call__ = timed(times["  of which Sampler.__call__ (launches)"], Sampler.__call__)
    sampling_inputs.fill_token_mask = timed(times["  of which fill_token_mask"], sampling_inputs.fill_token_mask)
    llm_engine.accept_tokens = timed(times["  of which accept_tokens"], llm_engine.accept_tokens)
    LogitsAdjuster.__call__ = timed(times["  of which LogitsAdjuster.__call__"], LogitsAdjuster.__call__)
    engine.scheduler.schedule = timed(times["  of which Scheduler.schedule"], engine.scheduler.schedule)
    # outside _step, the rest of the caller's loop: each request's admission, each step's outputs
    engine.add_request = timed(times["LLMEngine.add_request (outside _step)"], engine.add_request)
    engine.output_processor.outputs = timed(times["OutputProcessor.outputs (outside _step)"],
                                            engine.output_processor.outputs)
    for k, workload in enumerate(args.workload.split(",")):  # one engine for all of them
        prompts = random_prompts(args.num_prompts, args.input_len, llm.llm_engine.vocab_size, seed=k)
        params = sampling_params(workload, args.output_len, llm.llm_engine.vocab_size)
        for t in times.values():
            t.clear()  # the warm-up and graph capture (and the workload before) are not this one's steps
        last = k == len(args.workload.split(",")) - 1
        profile = cProfile.Profile() if args.cprofile and last else None
        start = time.perf_counter()
        if profile is not None:
            profile.enable()
        llm.generate([{"prompt_token_ids": q} for q in prompts], params, use_tqdm=False)
        if profile is not None:
            profile.disable()
        wall = time.perf_counter() - start
        if profile is not None:  # (under the profiler: its wall and medians read high, its shares do not)
            profile.dump_stats(args.cprofile)
            pstats.Stats(profile).sort_stats("tottime").print_stats(25)
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        print(f"# {workload} | {device} | torch {torch.__version__} | {args.model} | block_size "
              f"{llm.config.block_size} | {args.num_prompts} x {args.input_len} in x {args.output_len} out, "
              f"max_num_seqs {llm.config.max_num_seqs}, budget {llm.config.max_num_batched_tokens} | {wall:.2f} s")
        print("| host function | calls | median µs | p90 µs | total ms |")
        print("|---|---|---|---|---|")
        for name, t in times.items():
            if t:
                print(f"| {name} | {len(t)} | {np.median(t):.0f} | {np.percentile(t, 90):.0f} | {sum(t) / 1e3:.1f} |")
        print(f"per step: wall {wall * 1e6 / len(steps):.0f} µs, host busy {(sum(steps) - sum(waits)) / len(steps):.0f} µs "
              f"(_step less its waits for the device; the rest of the wall is the caller's loop)\n", flush=True)


if __name__ == "__main__":
    main()
