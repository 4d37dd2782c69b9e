"""Where the time of a step goes, on a GPU box: wall time per kind of step over a throughput run, then a
kernel profile of pure decode steps at a few batch sizes (GPU busy time against wall time per step), and
of one step that adds a prompt to a running decode batch (what a request arriving at a server costs the
requests already streaming).

    python3 scripts/profile_step.py --model /tmp/llama1b [--num-prompts 256 --input-len 256 --output-len 256]
    python3 scripts/profile_step.py --model /tmp/llama1b --request-rate 16   # arrivals as a server sees them
    python3 scripts/profile_step.py --model /dev/shm/llama8b --tensor-parallel-size 2   # rank 0's kernels, all-reduces apart
    python3 scripts/profile_step.py --model /tmp/llama1b --decode-workload json   # issue 20: JSON-mode decode steps
    python3 scripts/profile_step.py --model /tmp/llama1b --decode-batches 32 --kernel-order   # one step, in order

`--decode-workload json` profiles the decode steps with every request under `bench throughput`'s first JSON schema
(temperature 1): a GPU busy share well under the plain steps' says the host's grammar work (accepting tokens,
filling masks) holds the device back.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
import time

import torch
from torch.profiler import ProfilerActivity, profile

from flexengine import LLM, SamplingParams
from flexengine.benchmarks.common import as_requests, random_prompts
from flexengine.benchmarks.throughput import bench_penalties
from flexengine.compile import compile_count


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def device_us(event) -> float:
    return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)


def step_kinds(llm, prompts, output_len: int, request_rate: float) -> None:
    """Run the workload step by step; print wall time per kind of step. With a finite request_rate the
    prompts arrive at Poisson times and stream their outputs (delta=True), as the server runs them."""
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=1.0)
    gaps = torch.distributions.Exponential(request_rate).sample((len(prompts),)).tolist() if request_rate < float("inf") \
        else [0.0] * len(prompts)
    arrivals = list(itertools.accumulate(gaps))
    pending = collections.deque(zip(arrivals, prompts))
    streaming = request_rate < float("inf")

    def admit(now: float) -> None:
        while pending and pending[0][0] <= now:
            _, p = pending.popleft()
            engine.add_request(f"w{len(prompts) - len(pending)}", {"prompt_token_ids": p}, params,
                               final_only=not streaming, delta=streaming)
    kinds = collections.defaultdict(lambda: [0, 0.0, 0, 0.0])  # kind -> [steps, seconds, tokens, slowest]
    schedule = engine.scheduler.schedule
    last = {}

    def recording_schedule():
        last["batch"] = schedule()
        return last["batch"]

    engine.scheduler.schedule = recording_schedule
    before, start = compile_count(), time.perf_counter()
    while pending or engine.has_unfinished_requests():
        admit(time.perf_counter() - start)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0][0] - (time.perf_counter() - start)))
            continue
        t = time.perf_counter()
        engine.step()
        batch = last["batch"]
        n = len(batch.seqs)
        decode = all(k == 1 for k in batch.num_new_tokens)
        kind = f"decode {1 << (n - 1).bit_length() if n < 256 else n:>3}" if decode else "prefill/mixed"
        row = kinds[kind]
        row[0] += 1
        row[1] += time.perf_counter() - t
        row[2] += sum(batch.num_new_tokens)
        row[3] = max(row[3], time.perf_counter() - t)
    total = time.perf_counter() - start
    engine.scheduler.schedule = schedule
    print(f"# {len(prompts)} prompts at request rate {request_rate}: {total:.2f} s, "
          f"{len(prompts) * output_len / total:.0f} output tok/s, {compile_count() - before} graphs compiled during the run")
    print("| step kind | steps | ms per step | slowest ms | share of time | tokens per step |")
    print("|---|---|---|---|---|---|")
    for kind in sorted(kinds):
        steps, secs, toks, slowest = kinds[kind]
        print(f"| {kind} | {steps} | {secs / steps * 1e3:.2f} | {slowest * 1e3:.1f} | {secs / total:.0%} | "
              f"{toks / steps:.0f} |")


UNLIMITED = SamplingParams(max_tokens=None, ignore_eos=True, temperature=0)


def json_params() -> SamplingParams:
    """Every request under bench throughput's first schema; a grammar may end a request (then it stops)."""
    from flexengine import StructuredOutputsParams
    from flexengine.benchmarks.throughput import bench_schema
    return SamplingParams(max_tokens=None, temperature=1.0, structured_outputs=StructuredOutputsParams(json=bench_schema(0)))


def start_decoding(engine, ids: list[str], prompts: list[list[int]], params: SamplingParams = UNLIMITED) -> None:
    """Add the requests and step until every prompt is prefilled, plus one step.

    Prefill takes several steps, so requests run without a token limit (UNLIMITED) and are aborted
    afterwards: with one, the first admitted could finish before the last were prefilled."""
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": p}, params, final_only=True)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    engine.step()
    sync()


def profiled_steps(engine, steps: int):
    """(profiler, wall us per step) of `steps` engine steps."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        wall = (time.perf_counter() - start) / steps * 1e6
    return prof, wall


def print_kernels(prof, steps: int, wall: float, what: str) -> None:
    """GPU busy time against wall time per step, and every kernel (costliest first): the kernels-per-step count
    is only actionable with the whole list."""
    kernels = [(device_us(e), e.count, e.key) for e in prof.key_averages() if device_us(e) > 0]
    busy = sum(k[0] for k in kernels) / steps
    # tensor parallelism's collectives: NCCL's, and the one-shot sum through symmetric memory
    collective = sum(us for us, _, name in kernels if "nccl" in name.lower() or "one_shot_all_reduce" in name
                     or "one_shot_sum" in name) / steps
    print(f"# {what}: wall {wall:.0f} us per step, GPU busy {busy:.0f} us ({busy / wall:.0%}), "
          f"{sum(k[1] for k in kernels) / steps:.0f} kernels per step"
          + (f", all-reduces and gathers {collective:.0f} us ({collective / busy:.0%} of busy)" if collective else ""))
    print("| kernel | per step | us per step |")
    print("|---|---|---|")
    for us, count, name in sorted(kernels, reverse=True):
        print(f"| {name[:90]} | {count / steps:.1f} | {us / steps:.1f} |")


def print_kernel_order(prof, steps: int) -> None:
    """The last profiled step's device work in launch order: a generic Inductor name (`triton_poi_fused_0`, a combo
    kernel) is placed by its neighbours."""
    from torch.autograd import DeviceType
    work = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    print("| # | kernel, in launch order (the last step) | us |")
    print("|---|---|---|")
    for i, e in enumerate(work[len(work) - len(work) // steps:]):
        print(f"| {i} | {e.name[:90]} | {e.time_range.elapsed_us():.1f} |")


def profile_decode(llm, batch: int, input_len: int, steps: int = 8, workload: str = "plain",
                   kernel_order: bool = False) -> None:
    """Bring `batch` requests to decode, then profile `steps` pure decode steps of all of them."""
    engine = llm.llm_engine
    ids = [f"p{batch}-{i}" for i in range(batch)]
    params = {"json": json_params, "penalties": lambda: bench_penalties(engine.vocab_size, 0, None, 1.0),
              "sampled": lambda: dataclasses.replace(UNLIMITED, temperature=1.0)}.get(workload, lambda: UNLIMITED)()
    start_decoding(engine, ids, random_prompts(batch, input_len, engine.vocab_size, seed=batch), params)
    engine.step()
    prof, wall = profiled_steps(engine, steps)
    running = len(engine.scheduler.running)
    assert running == batch or workload == "json", "a request finished or was preempted while profiling"
    for rid in ids:
        engine.abort_request(rid)
    print_kernels(prof, steps, wall, f"{workload} decode batch {batch}" + (
        f" ({running} still running at the end)" if running != batch else ""))
    if kernel_order:
        print_kernel_order(prof, steps)


def profile_arrival(llm, batch: int, input_len: int) -> None:
    """Profile the one step that prefills a new prompt next to `batch` decoding requests."""
    engine = llm.llm_engine
    prompts = random_prompts(batch + 1, input_len, engine.vocab_size, seed=1000 + batch)
    ids = [f"a{batch}-{i}" for i in range(batch + 1)]
    start_decoding(engine, ids[:batch], prompts[:batch])
    engine.add_request(ids[-1], {"prompt_token_ids": prompts[-1]}, UNLIMITED, final_only=True)
    prof, wall = profiled_steps(engine, 1)
    for rid in ids:
        engine.abort_request(rid)
    print_kernels(prof, 1, wall, f"one {input_len}-token prompt arriving at {batch} decoding requests")
    host = sorted(((e.self_cpu_time_total, e.count, e.key) for e in prof.key_averages()), reverse=True)[:12]
    print("| host op (self CPU time) | count | us |")
    print("|---|---|---|")
    for us, count, name in host:
        print(f"| {name[:70]} | {count} | {us:.0f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model, for a CPU try)")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--decode-batches", default="1,64,256")
    p.add_argument("--decode-workload", default="plain", choices=["plain", "sampled", "json", "penalties"],
                   help="the profiled decode steps' requests: greedy, sampled at temperature 1 (json's and penalties' "
                        "baseline), under a JSON schema (xgrammar), or with bench throughput --penalties' settings")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="prompts arrive at this Poisson rate (per second) and stream, as at a server")
    p.add_argument("--arrival-batch", type=int, default=32,
                   help="decoding requests next to the arriving prompt in the profiled arrival step (0: skip)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks the model is sharded over; the profile is rank 0's (the engine's process)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context per request (default: the model's own; a short one builds faster)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="requests per step")
    p.add_argument("--kernel-order", action="store_true",
                   help="after each decode batch's table, its last step's kernels in launch order")
    args = p.parse_args()
    start = time.perf_counter()
    llm = LLM(args.model, dtype="bfloat16" if torch.cuda.is_available() else "auto",
              tensor_parallel_size=args.tensor_parallel_size, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    runner = llm.llm_engine.runner
    print(f"# engine built in {time.perf_counter() - start:.1f} s on {device}; attention {runner.backend.name}, "
          f"decode graphs {'on' if runner.decode_graphs else 'off'}")
    llm.generate(as_requests(random_prompts(4, args.input_len, llm.llm_engine.vocab_size, 1)),
                 SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    step_kinds(llm, random_prompts(args.num_prompts, args.input_len, llm.llm_engine.vocab_size, 0), args.output_len,
               args.request_rate)
    for b in map(int, args.decode_batches.split(",")):
        profile_decode(llm, b, args.input_len, workload=args.decode_workload, kernel_order=args.kernel_order)
    if args.arrival_batch:
        profile_arrival(llm, args.arrival_batch, args.input_len)


if __name__ == "__main__":
    main()
