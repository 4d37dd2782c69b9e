"""Offline throughput, as vLLM's benchmark_throughput measures it (random prompts, fixed lengths).

    flexengine bench throughput --model DIR --num-prompts 256 --input-len 256 --output-len 256

Only `generate` is timed; building the engine (load + compile + graph capture) and a tiny warm-up
generate are reported apart as the cold start. Every request produces exactly --output-len tokens
(ignore_eos), so the token counts are exact.

--json-schemas N puts every request under a JSON schema (N = 1: one shared schema; N = 16: 16 distinct
ones, round robin) and runs as many prompts unconstrained in the same process, each with exactly the
number of tokens its constrained twin produced (a grammar ends a request at its EOS, up to --output-len),
so the two runs do the same model work and their ratio is the grammar's cost. The constrained run is timed
from its first add_request, so the compiles of its new schemas are inside it; their times are stated. A second
round (other prompts, the schemas now compiled) follows; the ratio is of both rounds' sums.

--penalties gives every request repetition_penalty 1.1, presence and frequency penalties 0.5 and a 10-token
logit_bias, against plain sampling of other prompts, same lengths, same process: their ratio is what the
logits processors cost.

--prompt-logprobs K is lm-eval's loglikelihood request (max_tokens=1, prompt_logprobs=K; K = 1 is lm-eval's)
against the plain prefill of other prompts of the same length: prompt tokens/s of each, and their ratio.

Both run plain, feature, plain, feature (fresh prompts each time: no prefix-cache hits), so that what the
first run after the warm-up pays, and the box's drift, land on both sides; the ratio is of the sums, and
each run's seconds are in the JSON. The three modes exclude one another.
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch

from .common import (add_engine_arguments, as_requests, build_llm, check_lengths, compiled_graphs, device_name,
                     engine_mode, generate_fixed, random_prompts, timed, warm_up, write_json)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=256, help="requests, all submitted at once")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=256, help="generated tokens per request")
    p.add_argument("--temperature", type=float, default=1.0, help="1.0 as vLLM's benchmark; 0 is greedy")
    modes = p.add_mutually_exclusive_group()  # each compares two runs of its own; argparse rejects two
    modes.add_argument("--json-schemas", type=int, default=0, metavar="N",
                       help="structured outputs: every request under one of N distinct JSON schemas (1: all the "
                            "same), against the same requests unconstrained in the same run (needs xgrammar)")
    modes.add_argument("--penalties", action="store_true",
                       help="every request with repetition, presence and frequency penalties and a 10-token "
                            "logit_bias, against plain sampling of as many other prompts in the same run")
    modes.add_argument("--prompt-logprobs", type=int, default=None, metavar="K",
                       help="lm-eval's loglikelihood shape: max_tokens=1 (--output-len does not apply) and "
                            "prompt_logprobs=K, against plain prefill of as many other prompts in the same run")
    add_engine_arguments(p)


def main(args) -> int:
    llm, build_s = build_llm(args)
    warm_s = warm_up(llm, args.input_len, args.seed)
    prompts = random_prompts(args.num_prompts, args.input_len, llm.llm_engine.vocab_size, args.seed)
    if args.json_schemas > 0:
        return structured_main(args, llm, prompts)
    if args.penalties:
        return penalties_main(args, llm, prompts)
    if args.prompt_logprobs is not None:
        return prompt_logprobs_main(args, llm, prompts)
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
    rounds = []  # (constrained seconds, unconstrained seconds, output tokens, ttft medians); the first compiles
    for r in range(2):
        batch = prompts if r == 0 else random_prompts(n, args.input_len, llm.llm_engine.vocab_size, args.seed + 2)
        outs, constrained_s = timed(llm.generate, as_requests(batch), constrained, use_tqdm=False)
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        free = [SamplingParams(max_tokens=k, ignore_eos=True, temperature=args.temperature) for k in lengths]
        # other prompts of the same length: the constrained run's pages would be prefix-cache hits
        twins = random_prompts(n, args.input_len, llm.llm_engine.vocab_size, args.seed + 1 + 2 * r)
        free_outs, free_s = timed(llm.generate, as_requests(twins), free, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in free_outs] == lengths, "the unconstrained twins must match"
        ttft = {name: statistics.median(o.metrics.first_token_time - o.metrics.arrival_time for o in result)
                for name, result in (("constrained", outs), ("unconstrained", free_outs))}
        rounds.append((constrained_s, free_s, sum(lengths), ttft, sum(o.outputs[0].finish_reason == "stop" for o in outs)))
        if r == 0:
            compile_s = [grammars.compile_seconds[spec.key()] for spec in specs[:n]]  # (fewer prompts than schemas)
    constrained_s, free_s, tokens = (sum(x[i] for x in rounds) for i in range(3))
    print(f"# flexengine throughput, structured outputs | {device_name()} | {args.model or 'embedded default model'} "
          f"| {engine_mode(llm)} | {n} prompts x {args.input_len} in x up to {args.output_len} out | "
          f"{len(specs)} JSON schema(s) | two rounds, the first compiling the schemas")
    for r, (c, f, t, ttft, stopped) in enumerate(rounds):
        print(f"Round {r + 1}: {t} output tokens ({stopped} of {n} ended by the grammar); constrained "
              f"{t / c:.2f} tok/s ({c:.2f} s), unconstrained {t / f:.2f} tok/s ({f:.2f} s), ratio {f / c:.3f}; "
              f"median TTFT {ttft['constrained'] * 1e3:.1f} / {ttft['unconstrained'] * 1e3:.1f} ms")
    print(f"Ratio constrained / unconstrained, both rounds: {free_s / constrained_s:.3f}")
    print(f"Grammar compile (first request of each schema): first {compile_s[0] * 1e3:.1f} ms, "
          f"mean {statistics.mean(compile_s) * 1e3:.1f} ms, max {max(compile_s) * 1e3:.1f} ms")
    write_json(args.json_out, dict(
        bench="throughput_structured", device=device_name(), model=args.model, num_prompts=n,
        input_len=args.input_len, max_output_len=args.output_len, json_schemas=len(specs), output_tokens=tokens,
        constrained_s=constrained_s, unconstrained_s=free_s, constrained_tokens_per_s=tokens / constrained_s,
        unconstrained_tokens_per_s=tokens / free_s, ratio=free_s / constrained_s, compile_s=compile_s,
        ttft_median_s=rounds[0][3], rounds=[dict(constrained_s=c, unconstrained_s=f, output_tokens=t, ratio=f / c,
                                                 ttft_median_s=ttft) for c, f, t, ttft, _ in rounds]))
    return 0


def bench_logit_bias(vocab_size: int, seed: int) -> dict[int, float]:
    """10 distinct token ids from the vocabulary, biased +5 and -5 in turn."""
    ids = np.random.default_rng(seed).choice(vocab_size, size=10, replace=False).tolist()
    return {t: 5.0 if i % 2 else -5.0 for i, t in enumerate(ids)}


def bench_penalties(vocab_size: int, seed: int, max_tokens: int | None, temperature: float):
    """`--penalties`' requests: repetition 1.1, presence and frequency 0.5 and bench_logit_bias, past any EOS."""
    from flexengine import SamplingParams
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=temperature, repetition_penalty=1.1,
                          presence_penalty=0.5, frequency_penalty=0.5, logit_bias=bench_logit_bias(vocab_size, seed))


def alternate(llm, args, prompts, plain, feature) -> tuple[list[float], list[float]]:
    """Seconds of plain(prompts) and feature(prompts) runs, in the order plain, feature, plain, feature, each
    on prompts of its own (the same lengths)."""
    times = ([], [])
    for i in range(4):
        batch = prompts if i == 0 else random_prompts(args.num_prompts, args.input_len, llm.llm_engine.vocab_size,
                                                        args.seed + i)
        retries = alloc_retries()
        times[i % 2].append((plain if i % 2 == 0 else feature)(batch))
        if alloc_retries() > retries:  # the caching allocator freed its cache and synced to find memory
            print(f"run {i + 1}: {alloc_retries() - retries} CUDA allocation retries")
    return times


def alloc_retries() -> int:
    return torch.cuda.memory_stats().get("num_alloc_retries", 0) if torch.cuda.is_available() else 0


def penalties_main(args, llm, prompts) -> int:
    n = args.num_prompts
    params = bench_penalties(llm.llm_engine.vocab_size, args.seed, args.output_len, args.temperature)

    def penalised(batch) -> float:
        outs, seconds = timed(llm.generate, as_requests(batch), params, use_tqdm=False)
        check_lengths([len(o.outputs[0].token_ids) for o in outs], n, args.output_len, "penalised")
        return seconds
    plain_runs, penalised_runs = alternate(llm, args, prompts,
                                           lambda b: generate_fixed(llm, b, args.output_len, args.temperature), penalised)
    plain_s, penalised_s = sum(plain_runs), sum(penalised_runs)
    tokens = 2 * n * args.output_len
    print(f"# flexengine throughput, penalties | {device_name()} | {args.model or 'embedded default model'} | "
          f"{engine_mode(llm)} | {n} prompts x {args.input_len} in x {args.output_len} out")
    print(f"Penalised (repetition 1.1, presence 0.5, frequency 0.5, 10-token logit_bias): "
          f"{tokens / penalised_s:.2f} output tokens/s ({penalised_s:.2f} s)")
    print(f"Plain, same lengths: {tokens / plain_s:.2f} output tokens/s ({plain_s:.2f} s)")
    print(f"Ratio penalised / plain: {plain_s / penalised_s:.3f} (runs, in order: plain {plain_runs[0]:.2f} s, "
          f"penalised {penalised_runs[0]:.2f} s, plain {plain_runs[1]:.2f} s, penalised {penalised_runs[1]:.2f} s)")
    write_json(args.json_out, dict(
        bench="throughput_penalties", device=device_name(), model=args.model, num_prompts=n,
        input_len=args.input_len, output_len=args.output_len, output_tokens=tokens, penalised_s=penalised_s,
        plain_s=plain_s, penalised_tokens_per_s=tokens / penalised_s, plain_tokens_per_s=tokens / plain_s,
        ratio=plain_s / penalised_s, plain_runs_s=plain_runs, penalised_runs_s=penalised_runs))
    return 0


def prompt_logprobs_main(args, llm, prompts) -> int:
    from flexengine import SamplingParams
    n, k = args.num_prompts, args.prompt_logprobs
    scored = SamplingParams(max_tokens=1, ignore_eos=True, temperature=args.temperature, prompt_logprobs=k)
    reads = []

    def scoring(batch) -> float:
        outs, seconds = timed(llm.generate, as_requests(batch), scored, use_tqdm=False)
        # Every position read as vLLM's dict (lm-eval reads only the continuation's few; a server's echo reads
        # all), timed apart: one entry per prompt token, None only for the first, so a run that scored nothing fails.
        read, read_s = timed(lambda: [o.prompt_logprobs and o.prompt_logprobs[:] for o in outs])
        assert all(r is not None and len(r) == args.input_len and None not in r[1:] for r in read), \
            "every output must carry its prompt's logprobs"
        reads.append(read_s)
        return seconds
    plain_runs, scored_runs = alternate(llm, args, prompts, lambda b: generate_fixed(llm, b, 1, args.temperature),
                                        scoring)
    plain_s, scored_s, read_s = sum(plain_runs), sum(scored_runs), sum(reads)
    tokens = 2 * n * args.input_len
    print(f"# flexengine throughput, prompt logprobs | {device_name()} | {args.model or 'embedded default model'} "
          f"| {engine_mode(llm)} | {n} prompts x {args.input_len} in x 1 out | prompt_logprobs={k}")
    print(f"With prompt logprobs: {tokens / scored_s:.2f} prompt tokens/s ({scored_s:.2f} s)")
    print(f"Plain prefill: {tokens / plain_s:.2f} prompt tokens/s ({plain_s:.2f} s)")
    print(f"Ratio prompt logprobs / plain: {plain_s / scored_s:.3f} (runs, in order: plain {plain_runs[0]:.2f} s, "
          f"scored {scored_runs[0]:.2f} s, plain {plain_runs[1]:.2f} s, scored {scored_runs[1]:.2f} s)")
    print(f"Reading every position as a dict afterwards: {read_s:.2f} s (ratio with it: "
          f"{plain_s / (scored_s + read_s):.3f})")
    write_json(args.json_out, dict(
        bench="throughput_prompt_logprobs", device=device_name(), model=args.model, num_prompts=n,
        input_len=args.input_len, prompt_logprobs=k, prompt_tokens=tokens, prompt_logprobs_s=scored_s,
        plain_s=plain_s, prompt_logprobs_tokens_per_s=tokens / scored_s, plain_tokens_per_s=tokens / plain_s,
        ratio=plain_s / scored_s, read_every_position_s=read_s, ratio_with_reading=plain_s / (scored_s + read_s),
        plain_runs_s=plain_runs, prompt_logprobs_runs_s=scored_runs))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
