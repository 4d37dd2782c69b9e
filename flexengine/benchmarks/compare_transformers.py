"""flexengine against transformers on the same random prompts, in one process.

    python -m flexengine.benchmarks.compare_transformers --model DIR --num-prompts 256 --input-len 256 \
        --output-len 256 [--tf-num-prompts N] [--batch1]

Throughput: transformers' continuous batching (`model.generate_batch`, paged sdpa: attn_implementation
"paged|sdpa", or "sdpa" on a transformers that pages it by itself) against `flexengine.LLM.generate`, both
generating exactly --output-len tokens per prompt (EOS disabled), greedy by default. transformers' time is its
generation span (first request created → last finished, so its own CUDA-graph warm-up is excluded, as
flexengine's cold start is); the wall time of the whole generate_batch call is printed too. --batch1: ms/token of transformers
`generate` at batch 1 (dynamic and static cache) against flexengine, as `bench latency` measures it.
A transformers row that cannot run on the installed version is left out with the reason printed.
Time to first token: from each request's arrival (all arrive at the start, so queueing counts, as in
vLLM's offline benchmark) to the step that made its first token (`RequestOutput.metrics`); for
transformers where its outputs carry token timestamps.
"""
from __future__ import annotations

import argparse
import gc
import itertools
import math

import torch
import torch._dynamo

from .common import (add_engine_arguments, build_llm, check_lengths, decode_ms_per_token, device_name,
                     engine_mode, engine_model, generate_timed, hbm_bytes_per_s, random_prompts, timed, ttft_summary,
                     warm_up, weight_bytes, write_json)
from .latency import measure_decode


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=256, help="requests for flexengine")
    p.add_argument("--tf-num-prompts", type=int, default=None, help="requests for transformers (default: same)")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="both engines; 0 is greedy")
    p.add_argument("--tf-attn-implementation", default=None,
                   help="for generate_batch (default: paged|sdpa where this transformers lists it, as 5.17 does; "
                        "else sdpa, which later ones page by themselves)")
    p.add_argument("--tf-num-blocks", type=int, default=None, help="generate_batch KV blocks (default: auto)")
    p.add_argument("--tf-max-batch-tokens", type=int, default=None, help="generate_batch token budget (default: auto)")
    p.add_argument("--batch1", action="store_true", help="also compare batch-1 decode ms/token")
    p.add_argument("--batch1-input-len", type=int, default=128)
    p.add_argument("--batch1-output-len", type=int, default=256)
    p.add_argument("--batch1-iters", type=int, default=3)
    add_engine_arguments(p)


def model_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_hf_model(path: str, dtype: str, attn_implementation: str):
    from transformers import AutoModelForCausalLM
    torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation=attn_implementation)
    return model.to(model_device()).eval()


def hf_vocab_size(path: str) -> int:
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(path)
    return (config.get_text_config() if hasattr(config, "get_text_config") else config).vocab_size


def free_memory() -> str:
    """Drop what the last engine left behind, and say how much GPU memory is still taken."""
    torch._dynamo.reset()  # compiled code (static-cache generate) can keep the model alive
    gc.collect()
    if not torch.cuda.is_available():
        return "no GPU"
    torch.cuda.empty_cache()
    return f"{torch.cuda.memory_allocated() / 2 ** 30:.2f} GiB of GPU memory still allocated"


def generation_config(max_new_tokens: int, temperature: float, **extra):
    """Fixed lengths: eos_token_id=-1 matches no token, so only max_new_tokens ends a request."""
    from transformers import GenerationConfig
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
        dict(do_sample=False)
    return GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=-1, pad_token_id=0, **sampling, **extra)


def cb_config(args, num_prompts: int):
    from transformers.generation import ContinuousBatchingConfig
    sizes = dict(num_blocks=args.tf_num_blocks, max_batch_tokens=args.tf_max_batch_tokens)
    if model_device().type == "cpu":
        # Sized from system RAM otherwise, which takes minutes on CPU; 16-token pages is a safe upper bound.
        per_request = math.ceil((args.input_len + args.output_len) / 16)
        sizes = dict(num_blocks=sizes["num_blocks"] or num_prompts * per_request + 4,
                     max_batch_tokens=sizes["max_batch_tokens"] or 256)
    return ContinuousBatchingConfig(seed=args.seed, **{k: v for k, v in sizes.items() if v is not None})


def paged_sdpa() -> str:
    """generate_batch's paged sdpa by this transformers' name for it: "paged|sdpa" where its AttentionInterface
    lists that (5.17, the GPU boxes'), else "sdpa" (5.24 pages it by itself, warns at the prefix and says it
    drops it)."""
    from transformers import AttentionInterface
    return "paged|sdpa" if "paged|sdpa" in AttentionInterface() else "sdpa"


def transformers_generate_batch(args, prompts: list[list[int]]) -> tuple[dict | None, str]:
    """(row, note): generate_batch's output tok/s, or None and the reason it cannot be measured."""
    import transformers
    try:
        from transformers.generation import ContinuousBatchingConfig  # noqa: F401  (5.x only)
    except ImportError as e:
        return None, f"transformers {transformers.__version__} has no ContinuousBatchingConfig: {e}"
    attn_implementation = args.tf_attn_implementation or paged_sdpa()
    try:
        model = load_hf_model(args.model, args.dtype, attn_implementation)
    except (ValueError, ImportError) as e:
        return None, f"could not load the model with attn_implementation={attn_implementation!r}: {e}"
    if not hasattr(model, "generate_batch"):
        return None, f"transformers {transformers.__version__} has no generate_batch"
    gen = generation_config(args.output_len, args.temperature)
    try:
        results, wall = timed(model.generate_batch, inputs=prompts, generation_config=gen,
                              continuous_batching_config=cb_config(args, len(prompts)), progress_bar=False)
    except MemoryError as e:  # its cache sizing; on CPU, 5.17 sees 0 bytes free without psutil
        return None, f"generate_batch could not size its KV cache: {e}"
    attn = f"{attn_implementation}, config says {model.config._attn_implementation}"
    del model
    outs = list(results.values())
    failed = [o for o in outs if o.error is not None]
    if failed:
        return None, f"generate_batch: {len(failed)} of {len(prompts)} requests failed, e.g. {failed[0].error}"
    lengths = [len(o.generated_tokens) for o in outs]
    if len(outs) != len(prompts) or any(n != args.output_len for n in lengths):
        return None, (f"generate_batch returned {len(outs)} of {len(prompts)} requests with lengths "
                      f"{sorted(set(lengths))}, not all {args.output_len}")
    span = max(o.lifespan[1] for o in outs) - min(o.created_time for o in outs)
    # time to first token, where this transformers records token times (perf_counter, as created_time)
    ttft = ttft_summary([o.timestamps[0] - o.created_time for o in outs if getattr(o, "timestamps", None)])
    note = f"transformers generate_batch: attn {attn}; call wall {wall:.2f} s (incl. its warm-up), span {span:.2f} s"
    return dict(engine=f"transformers {transformers.__version__} generate_batch ({attn_implementation})",
                prompts=len(prompts), seconds=span, wall_s=wall, ttft=ttft), note


def transformers_batch1(args, vocab: int) -> list[dict]:
    """ms/token of transformers generate at batch 1, dynamic then static cache (median of iters)."""
    model = load_hf_model(args.model, args.dtype, "sdpa")
    seeds = itertools.count(args.seed + 1)
    rows = []
    for cache in (None, "static"):
        def run(n):
            ids = torch.tensor(random_prompts(1, args.batch1_input_len, vocab, next(seeds)), device=model.device)
            gen = generation_config(n, args.temperature, cache_implementation=cache)
            out, seconds = timed(model.generate, ids, attention_mask=torch.ones_like(ids), generation_config=gen)
            check_lengths([out.shape[1] - ids.shape[1]], 1, n, "transformers generate")
            return seconds
        run(args.batch1_output_len), run(1)  # warm-up; the static cache is sized (and compiled) by the longest
        full, one = [], []
        for _ in range(args.batch1_iters):
            full.append(run(args.batch1_output_len))
            one.append(run(1))
        rows.append(dict(engine=f"transformers generate, {cache or 'dynamic'} cache",
                         ms_per_token=decode_ms_per_token(full, one, args.batch1_output_len)))
    del model
    return rows


def flexengine_rows(args, prompts: list[list[int]]) -> tuple[dict, dict | None, float]:
    llm, build_s = build_llm(args)
    warm_s = warm_up(llm, args.input_len, args.seed)
    seconds, outputs = generate_timed(llm, prompts, args.output_len, args.temperature)
    mode = engine_mode(llm)
    ttft = ttft_summary([o.metrics.first_token_time - o.metrics.arrival_time for o in outputs])
    row = dict(engine=f"flexengine ({mode})", prompts=len(prompts), seconds=seconds, cold_start_s=build_s + warm_s,
               ttft=ttft)
    b1 = None
    if args.batch1:
        m = measure_decode(llm, 1, args.batch1_input_len, args.batch1_output_len, args.batch1_iters, 1,
                           args.temperature, args.seed)
        b1 = dict(engine=f"flexengine ({mode})", ms_per_token=m["ms_per_token"])
    nbytes = weight_bytes(engine_model(llm))
    del llm
    return row, b1, nbytes


def print_tables(args, rows: list[dict], b1_rows: list[dict], nbytes: int) -> None:
    print(f"\n# {device_name()} | torch {torch.__version__} | {args.model} | {args.input_len} in x "
          f"{args.output_len} out | {'greedy' if args.temperature == 0 else f'temperature {args.temperature}'}")
    print("| engine | prompts | seconds | output tok/s | time to first token, median / p90 |")
    print("|---|---|---|---|---|")
    for r in rows:
        r["output_tok_s"] = r["prompts"] * args.output_len / r["seconds"]
        engine = r["engine"].replace("|", "\\|")
        ttft = "—" if not r.get("ttft") else f"{r['ttft']['median']:.3f} s / {r['ttft']['p90']:.3f} s"
        print(f"| {engine} | {r['prompts']} | {r['seconds']:.3g} | {r['output_tok_s']:.1f} | {ttft} |")
    if len(rows) == 2:
        tf, fe = rows
        counts = "" if tf["prompts"] == fe["prompts"] else \
            f" (transformers ran {tf['prompts']} prompts, flexengine {fe['prompts']})"
        print(f"flexengine / transformers output tok/s: {fe['output_tok_s'] / tf['output_tok_s']:.2f}x{counts}")
    if b1_rows:
        bandwidth = hbm_bytes_per_s()
        floor = nbytes / bandwidth * 1e3
        print(f"\n| batch 1, {args.batch1_input_len} in x {args.batch1_output_len} out | ms/token |")
        print("|---|---|")
        for r in b1_rows:
            print(f"| {r['engine']} | {r['ms_per_token']:.3f} |")
        print(f"| weight-read floor ({nbytes / 1e9:.2f} GB at {bandwidth / 1e12:.1f} TB/s) | {floor:.4g} |")


def main(args) -> int:
    if args.model is None:
        raise SystemExit("--model DIR is required: transformers loads the same checkpoint")
    vocab = hf_vocab_size(args.model)
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    tf_prompts = prompts[:args.tf_num_prompts or args.num_prompts]
    rows, b1_rows = [], []
    tf_row, note = transformers_generate_batch(args, tf_prompts)
    print(note if tf_row else f"transformers generate_batch row missing: {note}")
    rows += [tf_row] if tf_row else []
    print(f"after transformers generate_batch: {free_memory()}")
    if args.batch1:
        b1_rows += transformers_batch1(args, vocab)
        print(f"after transformers generate: {free_memory()}")
    fe_row, fe_b1, nbytes = flexengine_rows(args, prompts)
    rows.append(fe_row)
    b1_rows += [fe_b1] if fe_b1 else []
    print_tables(args, rows, b1_rows, nbytes)
    write_json(args.json_out, dict(bench="compare_transformers", device=device_name(), model=args.model,
                                   input_len=args.input_len, output_len=args.output_len, rows=rows,
                                   batch1=b1_rows, weight_bytes=nbytes, transformers_note=note))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
