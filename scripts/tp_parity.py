"""Greedy tokens and logprobs of tensor parallelism against one rank, on one checkpoint (issue 23, item 1).

    python3 scripts/tp_parity.py --model /dev/shm/llama8b --tensor-parallel-size 2 [--json out.json]
    python3 scripts/tp_parity.py --model CKPT --tensor-parallel-size 2 --device cpu   # gloo, a dry run

Each size runs in a process of its own (a TP=1 engine would keep its KV cache on GPU 0 while the TP=N
one starts), on the same random prompts, with `logprobs=1`. Per prompt it reports whether the greedy
tokens are identical, where they first part, and the largest difference of the chosen tokens' logprobs
before that (bf16 sums the shards' partial products in another order than one GEMM, so tokens may part
where two candidates are within rounding; the logprobs say how close they were).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def run_one(args, size: int, out: str) -> None:
    """One engine of `size` ranks: its greedy tokens and their logprobs, to `out` (JSON)."""
    import torch

    from flexengine import LLM, SamplingParams
    from flexengine.benchmarks.common import as_requests, random_prompts, show_engine_info, timed
    from flexengine.compile import compile_count
    show_engine_info()  # KV cache, warm-up and capture seconds in the log of each size
    if torch.cuda.is_available() and args.device != "cpu":  # what the docs' tables name: the cards, torch, NCCL
        print(f"# TP={size}: {torch.cuda.device_count()} x {torch.cuda.get_device_name()} | torch {torch.__version__} "
              f"| NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}", flush=True)
    dtype = args.dtype or ("bfloat16" if torch.cuda.is_available() and args.device != "cpu" else "float32")
    # no prefix cache: the noise run repeats the parity prompts, and must compute them afresh, not read their pages
    llm, build_s = timed(LLM, args.model, dtype=dtype, device=args.device, tensor_parallel_size=size,
                         enable_prefix_caching=False,
                         max_model_len=max(args.input_len + args.max_tokens, 2 * args.speed_len * args.speed) + 16)
    prompts = random_prompts(args.num_prompts, args.input_len, llm.llm_engine.vocab_size, args.seed)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=1)
    llm.generate(as_requests(prompts[:1]), params, use_tqdm=False)  # first-call costs
    before = compile_count()
    outs = llm.generate(as_requests(prompts), params, use_tqdm=False)
    rows = greedy_rows(outs)
    after_parity = compile_count()
    # bf16's own noise at this size: the same prompts one at a time (other GEMM shapes, other rounding)
    alone_rows = greedy_rows([llm.generate(as_requests([p]), params, use_tqdm=False)[0] for p in prompts]
                             if size == 1 else [])
    speed = measure_speed(llm, args.seed, args.speed_batch, args.speed_len) if args.speed else None
    if speed is not None:
        speed["compiled"] = compile_count() - after_parity  # the benchmark's shapes, after warm-up too
    runner = llm.llm_engine.runner
    json.dump(dict(size=size, dtype=dtype, rows=rows, alone_rows=alone_rows, compiled_after_warm_up=after_parity - before,
                   decode_graphs=runner.decode_graphs is not None, build_s=build_s, speed=speed,
                   mixed_graphs=getattr(runner, "mixed_graphs", None) is not None), open(out, "w"))
    print(f"# TP={size} measured: {json.dumps(speed)}", flush=True)  # in the log even if what follows hangs
    started = time.perf_counter()
    llm.llm_engine.shutdown()
    print(f"# TP={size} shut down in {time.perf_counter() - started:.1f} s", flush=True)


def greedy_rows(outs) -> list[dict]:
    """Each request's tokens and their logprobs, as compare() reads them."""
    return [dict(tokens=o.outputs[0].token_ids,
                 logprobs=[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
            for o in outs]


def measure_speed(llm, seed: int, batch: int, length: int) -> dict:
    """Issue 23's two targets on this engine, as `bench latency` and `bench throughput` measure them: batch-1
    decode ms/token (`length` / 2 in x `length` out, 3 timed runs, median) and `batch` x `length` x `length` output
    tokens/s (2 timed runs, each given). Issue 23's shapes are length 256, batch 256."""
    import statistics

    import torch

    from flexengine.benchmarks.common import generate_fixed, random_prompts
    from flexengine.benchmarks.latency import measure_decode
    vocab = llm.llm_engine.vocab_size
    latency = measure_decode(llm, 1, length // 2, length, num_iters=3, num_warmup=1, temperature=1.0, seed=seed + 1)
    generate_fixed(llm, random_prompts(min(32, batch), length, vocab, seed + 2), 8, 1.0)  # first-call costs
    runs = [generate_fixed(llm, random_prompts(batch, length, vocab, seed + 3 + i), length, 1.0) for i in range(2)]
    if torch.cuda.is_available():  # rank 0's kernels per decode step; with TP, the all-reduces' share of them
        from profile_step import profile_decode  # scripts/, beside this file
        for rows in (1, batch):
            profile_decode(llm, rows, length // 2)
    return dict(batch1_ms_per_token=latency["ms_per_token"], throughput_runs_s=runs,
                output_tokens_per_s=[batch * length / t for t in runs],
                median_output_tokens_per_s=batch * length / statistics.median(runs))


def run_child(cmd: list[str], out: str, env: dict | None = None, grace_s: float = 60.0) -> int:
    """Run one size; once it has written `out`, give it `grace_s` to shut down, then kill it (a hung
    shutdown is reported, and does not cost the measurements)."""
    child = subprocess.Popen(cmd, env=None if env is None else {**os.environ, **env})
    written_at = None
    while child.poll() is None:
        time.sleep(1.0)
        if written_at is None and os.path.exists(out):
            written_at = time.monotonic()
        if written_at is not None and time.monotonic() - written_at > grace_s:
            print(f"# the engine did not exit within {grace_s:.0f} s of its results: killed", flush=True)
            child.kill()
            return child.wait()
    return child.returncode


def compare(one: dict, many: dict) -> dict:
    """Per prompt: identical or where the tokens part, and the largest chosen-token logprob difference up to
    there; over every such position of every prompt, the median and 90th percentile difference (a fairer
    yardstick than the maximum, which grows with how long the tokens stay together)."""
    import statistics
    prompts, diffs = [], []
    for a, b in zip(one["rows"], many["rows"]):
        parted = next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), None)
        upto = len(a["tokens"]) if parted is None else parted + 1  # the parting position's own logprob too
        d = [abs(x - y) for x, y in zip(a["logprobs"][:upto], b["logprobs"][:upto])]
        diffs += d
        prompts.append(dict(identical=parted is None, parted_at=parted, max_logprob_diff=max(d, default=0.0)))
    deciles = statistics.quantiles(diffs, n=10, method="inclusive") if len(diffs) > 1 else diffs * 9 or [0.0] * 9
    return dict(prompts=prompts, identical=sum(p["identical"] for p in prompts),
                max_logprob_diff=max(p["max_logprob_diff"] for p in prompts), positions=len(diffs),
                median_logprob_diff=statistics.median(diffs) if diffs else 0.0, p90_logprob_diff=deciles[8])


def parted(row: dict) -> str:
    return "-" if row["parted_at"] is None else str(row["parted_at"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=2)
    p.add_argument("--device", default="auto", help="cpu for a gloo dry run (default: auto, the engine's choice)")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on the CPU")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--speed", action="store_true",
                   help="also, on the same engines: batch-1 ms/token and 256 x 256 x 256 tokens/s at each size")
    p.add_argument("--speed-batch", type=int, default=256, help="--speed's throughput requests (CPU dry runs: fewer)")
    p.add_argument("--speed-len", type=int, default=256, help="--speed's prompt and output tokens")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:VAR=VALUE[,VAR=VALUE]",
                   help="one more TP=N engine with these environment variables, against the same TP=1 (e.g. "
                        "one_shot:FLEXENGINE_ALL_REDUCE=one_shot); repeatable")
    p.add_argument("--json", default=None)
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child: this size only
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one is not None:
        run_one(args, args.one, args.out)
        return 0
    results, variants = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for size in (1, args.tensor_parallel_size):
            out = f"{tmp}/tp{size}.json"
            code = run_child([sys.executable, __file__, *sys.argv[1:], "--one", str(size), "--out", out], out)
            if not os.path.exists(out):  # what the sizes before it measured still gets out
                print(f"TP={size} failed (exit {code}); measured before it: {json.dumps(results)}")
                return 1
            results[size] = json.load(open(out))
        for name, env in map(parse_variant, args.variant):  # a failed variant loses only itself
            out = f"{tmp}/{name}.json"
            code = run_child([sys.executable, __file__, *sys.argv[1:], "--one", str(args.tensor_parallel_size),
                              "--out", out], out, env)
            variants[name] = dict(env=env, **json.load(open(out))) if os.path.exists(out) else dict(env=env, failed=code)
    one, many = results[1], results[args.tensor_parallel_size]
    report = dict(model=args.model, dtype=one["dtype"], tensor_parallel_size=args.tensor_parallel_size,
                  num_prompts=args.num_prompts, input_len=args.input_len, max_tokens=args.max_tokens,
                  **compare(one, many),
                  graphs={size: dict(decode=r["decode_graphs"], mixed=r["mixed_graphs"],
                                     compiled_after_warm_up=r["compiled_after_warm_up"])
                          for size, r in results.items()})
    print(f"# TP={args.tensor_parallel_size} against TP=1, {args.num_prompts} prompts x {args.input_len} in, "
          f"{args.max_tokens} greedy tokens, {one['dtype']}")
    noise = compare(one, dict(rows=one["alone_rows"]))  # TP=1 batched against TP=1 one prompt at a time
    report["noise"] = noise
    print("| prompt | tokens identical | first differing token | largest logprob difference before it "
          "| TP=1 alone against TP=1 batched: the same three |")
    print("|---|---|---|---|---|")
    for i, (row, ref) in enumerate(zip(report["prompts"], noise["prompts"])):
        print(f"| {i} | {'yes' if row['identical'] else 'no'} | {parted(row)} | {row['max_logprob_diff']:.2e} "
              f"| {'yes' if ref['identical'] else 'no'}, {parted(ref)}, {ref['max_logprob_diff']:.2e} |")
    print(f"identical: {report['identical']} of {args.num_prompts} (TP=1 alone against batched: {noise['identical']}); "
          f"largest logprob difference {report['max_logprob_diff']:.2e} (noise: {noise['max_logprob_diff']:.2e}); "
          f"per position before the tokens part: median {report['median_logprob_diff']:.2e}, 90th percentile "
          f"{report['p90_logprob_diff']:.2e} over {report['positions']} (noise: {noise['median_logprob_diff']:.2e}, "
          f"{noise['p90_logprob_diff']:.2e} over {noise['positions']}); "
          f"graphs and compiles after warm-up: {report['graphs']}")
    if args.speed:
        a, b = one["speed"], many["speed"]
        report["speed"] = {size: r["speed"] for size, r in results.items()}
        shape = f"{args.speed_batch} x {args.speed_len} x {args.speed_len}"
        print(f"\n| TP | batch-1 ms/token | {shape} output tok/s (runs) | engine built in | compiled while "
              "timed |\n|---|---|---|---|---|")
        for size, r in results.items():
            sp = r["speed"]
            print(f"| {size} | {sp['batch1_ms_per_token']:.3f} | {sp['median_output_tokens_per_s']:.0f} "
                  f"({', '.join(f'{x:.0f}' for x in sp['output_tokens_per_s'])}) | {r['build_s']:.1f} s | "
                  f"{sp['compiled']} |")
        print(f"TP={args.tensor_parallel_size} / TP=1: batch 1 {a['batch1_ms_per_token'] / b['batch1_ms_per_token']:.2f}x "
              f"faster (target 1.6x), throughput {b['median_output_tokens_per_s'] / a['median_output_tokens_per_s']:.2f}x "
              f"(target 1.3x)")
    if variants:
        report["variants"] = report_variants(args, one, variants)
    if args.json:
        json.dump(report, open(args.json, "w"), indent=1)
    return 0


def parse_variant(spec: str) -> tuple[str, dict]:
    name, _, assignments = spec.partition(":")
    env = dict(a.split("=", 1) for a in assignments.split(",") if a)
    if not name or not env:
        raise SystemExit(f"--variant {spec!r}: expected NAME:VAR=VALUE[,VAR=VALUE]")
    return name, env


def report_variants(args, one: dict, variants: dict) -> dict:
    """Each variant's TP=N engine against the same TP=1: parity, and with --speed its two ratios."""
    n = args.tensor_parallel_size
    print(f"\n| TP={n} variant | environment | tokens identical (of {args.num_prompts}) | largest logprob difference "
          "| batch-1 ms/token | batch-1 vs TP=1 | output tok/s | throughput vs TP=1 |\n|---|---|---|---|---|---|---|---|")
    report = {}
    for name, r in variants.items():
        env = " ".join(f"{k}={v}" for k, v in r["env"].items())
        if "failed" in r:
            print(f"| {name} | {env} | failed (exit {r['failed']}) | | | | | |")
            report[name] = r
            continue
        parity = compare(one, r)
        report[name] = dict(env=r["env"], identical=parity["identical"], max_logprob_diff=parity["max_logprob_diff"],
                            median_logprob_diff=parity["median_logprob_diff"], speed=r["speed"],
                            compiled_after_warm_up=r["compiled_after_warm_up"])
        speed = ("| | | | |" if not args.speed else
                 f"| {r['speed']['batch1_ms_per_token']:.3f} "
                 f"| {one['speed']['batch1_ms_per_token'] / r['speed']['batch1_ms_per_token']:.2f}x "
                 f"| {r['speed']['median_output_tokens_per_s']:.0f} "
                 f"| {r['speed']['median_output_tokens_per_s'] / one['speed']['median_output_tokens_per_s']:.2f}x |")
        print(f"| {name} | {env} | {parity['identical']} | {parity['max_logprob_diff']:.2e} {speed}")
    return report


if __name__ == "__main__":
    raise SystemExit(main())
