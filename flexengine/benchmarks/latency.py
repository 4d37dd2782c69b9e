"""Per-token decode latency at a fixed batch size, against the weight-read floor.

    flexengine bench latency --model DIR --batch-size 1 --input-len 128 --output-len 256

decode ms/token = (median time for output_len tokens - median time for 1 token) / (output_len - 1):
the prefill is the same in both, so it cancels. The floor is one read of every weight per decode
step (a tied embedding counted once) at --hbm-bandwidth; "achieved" = floor / measured.
Each call gets fresh random prompts, so the prefix cache never turns a prefill into a hit.
"""
from __future__ import annotations

import argparse
import itertools
import statistics

import numpy as np

from .common import (add_engine_arguments, build_llm, decode_ms_per_token, device_name, engine_mode,
                     engine_model, generate_fixed, hbm_bytes_per_s, random_prompts, warm_up, weight_bytes,
                     write_json)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=int, default=1, help="requests decoded together")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=256, help="generated tokens per request (>= 2)")
    p.add_argument("--num-iters", type=int, default=3, help="timed runs of each length (median)")
    p.add_argument("--num-iters-warmup", type=int, default=1, help="untimed runs of each length first")
    p.add_argument("--temperature", type=float, default=1.0, help="1.0 as vLLM's benchmark; 0 is greedy")
    p.add_argument("--hbm-bandwidth", type=float, default=None,
                   help="bytes/s for the floor (default: 3.0e12 on an H100, 4.3e12 on an H200)")
    add_engine_arguments(p)


def measure_decode(llm, batch_size: int, input_len: int, output_len: int, num_iters: int, num_warmup: int,
                   temperature: float, seed: int) -> dict:
    """Times of generate for output_len tokens and for 1 token, alternating, fresh prompts each call."""
    if output_len < 2:
        raise ValueError(f"--output-len must be >= 2 to separate decode from prefill, got {output_len}")
    vocab = llm.llm_engine.vocab_size
    seeds = itertools.count(seed + 1)
    run = lambda n: generate_fixed(llm, random_prompts(batch_size, input_len, vocab, next(seeds)), n,  # noqa: E731
                                   temperature)
    for _ in range(num_warmup):
        run(output_len), run(1)
    full, one = [], []
    for _ in range(num_iters):
        full.append(run(output_len))
        one.append(run(1))
    return dict(full_s=full, one_s=one, ms_per_token=decode_ms_per_token(full, one, output_len))


def floor_ms(llm, bandwidth: float) -> tuple[int, float]:
    nbytes = weight_bytes(engine_model(llm))
    return nbytes, nbytes / bandwidth * 1e3


def main(args) -> int:
    llm, build_s = build_llm(args)
    warm_s = warm_up(llm, args.input_len, args.seed, num_prompts=args.batch_size)
    m = measure_decode(llm, args.batch_size, args.input_len, args.output_len, args.num_iters,
                       args.num_iters_warmup, args.temperature, args.seed)
    bandwidth = args.hbm_bandwidth or hbm_bytes_per_s()
    nbytes, floor = floor_ms(llm, bandwidth)
    full = np.array(m["full_s"])
    mode = engine_mode(llm)
    print(f"# flexengine latency | {device_name()} | {args.model or 'embedded default model'} | {mode} | "
          f"batch {args.batch_size} x {args.input_len} in x {args.output_len} out | {args.num_iters} iters")
    print(f"Avg latency: {full.mean():.4f} seconds")
    for pct in (50, 90, 99):
        print(f"{pct}% percentile latency: {np.percentile(full, pct):.4f} seconds")
    print(f"Prefill + 1 token (median): {statistics.median(m['one_s']) * 1e3:.2f} ms")
    print(f"Decode: {m['ms_per_token']:.3f} ms per output token "
          f"({args.batch_size / m['ms_per_token'] * 1e3:.1f} output tokens/s)")
    print(f"Weight-read floor: {floor:.4g} ms per step ({nbytes / 1e9:.2f} GB at {bandwidth / 1e12:.2f} TB/s)")
    print(f"Achieved fraction of floor: {floor / m['ms_per_token']:.3g}")
    print(f"Cold start (load + compile + graph capture): {build_s + warm_s:.2f} s")
    write_json(args.json_out, dict(
        bench="latency", device=device_name(), model=args.model, enforce_eager=args.enforce_eager,
        batch_size=args.batch_size, input_len=args.input_len, output_len=args.output_len, **m,
        avg_latency_s=float(full.mean()), weight_bytes=nbytes, floor_ms=floor,
        achieved_fraction=floor / m["ms_per_token"], cold_start_s=build_s + warm_s))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
