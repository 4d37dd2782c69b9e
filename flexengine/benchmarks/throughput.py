"""Offline throughput, as vLLM's benchmark_throughput measures it (random prompts, fixed lengths).

    flexengine bench throughput --model DIR --num-prompts 256 --input-len 256 --output-len 256

Only `generate` is timed; building the engine (load + compile + graph capture) and a tiny warm-up
generate are reported apart as the cold start. Every request produces exactly --output-len tokens
(ignore_eos), so the token counts are exact.
"""
from __future__ import annotations

import argparse

from .common import (add_engine_arguments, build_llm, compiled_graphs, device_name, engine_mode, generate_fixed,
                     random_prompts, warm_up, write_json)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=256, help="requests, all submitted at once")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=256, help="generated tokens per request")
    p.add_argument("--temperature", type=float, default=1.0, help="1.0 as vLLM's benchmark; 0 is greedy")
    add_engine_arguments(p)


def main(args) -> int:
    llm, build_s = build_llm(args)
    warm_s = warm_up(llm, args.input_len, args.seed)
    prompts = random_prompts(args.num_prompts, args.input_len, llm.llm_engine.vocab_size, args.seed)
    graphs_before = compiled_graphs()
    elapsed = generate_fixed(llm, prompts, args.output_len, args.temperature)
    recompiles = compiled_graphs() - graphs_before

    output_tokens = args.num_prompts * args.output_len
    total_tokens = args.num_prompts * (args.input_len + args.output_len)
    mode = engine_mode(llm)
    print(f"# flexengine throughput | {device_name()} | {args.model or 'embedded default model'} | {mode} | "
          f"{args.num_prompts} prompts x {args.input_len} in x {args.output_len} out | {elapsed:.2f} s")
    print(f"Throughput: {args.num_prompts / elapsed:.2f} requests/s, {total_tokens / elapsed:.2f} total tokens/s, "
          f"{output_tokens / elapsed:.2f} output tokens/s")
    print(f"Cold start (load + compile + graph capture): {build_s + warm_s:.2f} s "
          f"(construction {build_s:.2f} s, warm-up generate {warm_s:.2f} s)")
    # A graph compiled inside the timed run means its compile time is in the number above.
    print(f"Graphs compiled during the timed run: {recompiles}")
    write_json(args.json_out, dict(
        bench="throughput", device=device_name(), model=args.model, enforce_eager=args.enforce_eager,
        num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
        elapsed_s=elapsed, requests_per_s=args.num_prompts / elapsed, total_tokens_per_s=total_tokens / elapsed,
        output_tokens_per_s=output_tokens / elapsed, cold_start_s=build_s + warm_s, construction_s=build_s,
        warmup_s=warm_s, graphs_compiled_in_timed_run=recompiles))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
