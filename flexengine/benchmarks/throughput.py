"""Offline throughput, as vLLM's benchmark_throughput measures it (random prompts, fixed lengths).

    flexengine bench throughput --model DIR --num-prompts 256 --input-len 256 --output-len 256

Only `generate` is timed; building the engine (load + compile + graph capture) and a tiny warm-up
generate are reported apart as the cold start. Every request produces exactly --output-len tokens
(ignore_eos), so the token counts are exact.

--json-schemas N puts every request under a JSON schema (N = 1: one shared schema; N = 16: 16 distinct
ones, round robin) and runs as many prompts unconstrained in the same process, each with exactly the
number of tokens its constrained twin produced (a grammar ends a request at its EOS, up to --output-len),
so the two runs do the same model work and their ratio is the grammar's cost. The constrained run is timed
from its first add_request, so the compiles of its new schemas are inside it; their times are stated.
"""
from __future__ import annotations

import argparse
import statistics

from .common import (add_engine_arguments, as_requests, build_llm, compiled_graphs, device_name, engine_mode,
                     generate_fixed, random_prompts, timed, warm_up, write_json)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=256, help="requests, all submitted at once")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=256, help="generated tokens per request")
    p.add_argument("--temperature", type=float, default=1.0, help="1.0 as vLLM's benchmark; 0 is greedy")
    p.add_argument("--json-schemas", type=int, default=0, metavar="N",
                   help="structured outputs: every request under one of N distinct JSON schemas (1: all the "
                        "same), against the same requests unconstrained in the same run (needs xgrammar)")
    add_engine_arguments(p)


def main(args) -> int:
    llm, build_s = build_llm(args)
    warm_s = warm_up(llm, args.input_len, args.seed)
    prompts = random_prompts(args.num_prompts, args.input_len, llm.llm_engine.vocab_size, args.seed)
    if args.json_schemas > 0:
        return structured_main(args, llm, prompts)
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


def bench_schema(i: int) -> dict:
    """A record schema with room for long output (free strings and a list), distinct per i."""
    return {"type": "object", "properties": {
        f"id_{i}": {"type": "integer"}, f"title_{i}": {"type": "string"},
        f"kind_{i}": {"enum": ["alpha", "beta", f"gamma_{i}"]},
        f"tags_{i}": {"type": "array", "items": {"type": "string"}},
        f"notes_{i}": {"type": "string"}},
        "required": [f"id_{i}", f"title_{i}", f"kind_{i}", f"tags_{i}", f"notes_{i}"]}


def structured_main(args, llm, prompts) -> int:
    from flexengine import SamplingParams, StructuredOutputsParams
    n = args.num_prompts
    specs = [StructuredOutputsParams(json=bench_schema(i)) for i in range(args.json_schemas)]
    constrained = [SamplingParams(max_tokens=args.output_len, temperature=args.temperature,
                                  structured_outputs=specs[i % len(specs)]) for i in range(n)]
    grammars = llm.llm_engine.grammars
    outs, constrained_s = timed(llm.generate, as_requests(prompts), constrained, use_tqdm=False)
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    compile_s = [grammars.compile_seconds[spec.key()] for spec in specs]
    free = [SamplingParams(max_tokens=k, ignore_eos=True, temperature=args.temperature) for k in lengths]
    # other prompts of the same length: the constrained run's pages would be prefix-cache hits
    twins = random_prompts(n, args.input_len, llm.llm_engine.vocab_size, args.seed + 1)
    free_outs, free_s = timed(llm.generate, as_requests(twins), free, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in free_outs] == lengths, "the unconstrained twins must match"
    tokens = sum(lengths)
    ttft = {name: statistics.median(o.metrics.first_token_time - o.metrics.arrival_time for o in result)
            for name, result in (("constrained", outs), ("unconstrained", free_outs))}
    print(f"# flexengine throughput, structured outputs | {device_name()} | {args.model or 'embedded default model'} "
          f"| {engine_mode(llm)} | {n} prompts x {args.input_len} in x up to {args.output_len} out | "
          f"{len(specs)} JSON schema(s)")
    print(f"Output tokens: {tokens} (mean {tokens / n:.1f} per request; "
          f"{sum(o.outputs[0].finish_reason == 'stop' for o in outs)} of {n} ended by the grammar)")
    print(f"Constrained: {tokens / constrained_s:.2f} output tokens/s ({constrained_s:.2f} s)")
    print(f"Unconstrained, same lengths: {tokens / free_s:.2f} output tokens/s ({free_s:.2f} s)")
    print(f"Ratio constrained / unconstrained: {free_s / constrained_s:.3f}")
    print(f"Grammar compile (first request of each schema): first {compile_s[0] * 1e3:.1f} ms, "
          f"mean {statistics.mean(compile_s) * 1e3:.1f} ms, max {max(compile_s) * 1e3:.1f} ms")
    print(f"Median time to first token: constrained {ttft['constrained'] * 1e3:.1f} ms, "
          f"unconstrained {ttft['unconstrained'] * 1e3:.1f} ms")
    write_json(args.json_out, dict(
        bench="throughput_structured", device=device_name(), model=args.model, num_prompts=n,
        input_len=args.input_len, max_output_len=args.output_len, json_schemas=len(specs), output_tokens=tokens,
        constrained_s=constrained_s, unconstrained_s=free_s, constrained_tokens_per_s=tokens / constrained_s,
        unconstrained_tokens_per_s=tokens / free_s, ratio=free_s / constrained_s, compile_s=compile_s,
        ttft_median_s=ttft))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
