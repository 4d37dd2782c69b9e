"""Long-prompt prefill: flexengine against transformers' plain forward, on the same prompts, in one process.

    python -m flexengine.benchmarks.long_context --model DIR [--lengths 8192,16384,32768,65536]
        [--total-tokens 65536] [--max-model-len N]

For each length L, total_tokens / L random prompts (so every row prefills as many tokens) are run:
- transformers: `model.model(ids)` with attn_implementation="sdpa", one prompt at a time (no lm_head, no
  cache kept): the cheapest prefill transformers offers, and the bar of issue 24;
- flexengine: `LLM.generate(max_tokens=1)`, all prompts at once, twice on fresh prompts (both runs are
  printed: their spread is the noise); the time of one prompt alone is its time to first token.
The floor is the FLOPs of the forward at a reachable dense bf16 rate (790 TFLOP/s on the H100, the
figure issue 24 uses): 2 x non-embedding parameters per token plus causal attention, 2 x L^2 x heads x
head_dim per layer (QK^T and PV over half the square).
The engine's max_model_len is its default (the model's whole context) unless --max-model-len is given.
"""
from __future__ import annotations

import argparse

import torch

from .common import add_engine_arguments, build_llm, device_name, random_prompts, timed, write_json
from .compare_transformers import free_memory, hf_vocab_size, load_hf_model

REACHABLE_FLOPS = 790e12


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", default="8192,16384,32768,65536", help="prompt lengths, comma-separated")
    p.add_argument("--total-tokens", type=int, default=65536, help="prompt tokens per row (prompts = this / length)")
    p.add_argument("--skip-transformers", action="store_true", help="flexengine only (no ratio)")
    p.add_argument("--fa4-q-tiles", type=int, default=None, metavar="N",
                   help="128-row prefill tiles per q block of the FA4 call in steps over long contexts (default: the "
                        "engine's, 3 on Hopper at head size <= 64: compile.wide_q_tiles; 1 turns the wide blocks off)")
    add_engine_arguments(p)


def floor_seconds(spec: dict, num: int, length: int) -> float:
    """The forward's FLOPs at REACHABLE_FLOPS: matmul weights per token plus causal attention."""
    weights = 2 * spec["matmul_params"] * num * length
    attention = 2 * length * length * spec["heads"] * spec["head_dim"] * spec["layers"] * num
    return (weights + attention) / REACHABLE_FLOPS


def transformers_prefill(args, prompts: dict[int, torch.Tensor]) -> tuple[dict[int, float], dict]:
    """{length: seconds of the forward over its prompts}, and the model's shape for the floor."""
    model = load_hf_model(args.model, args.dtype, "sdpa")
    cfg = model.config.get_text_config()
    embed = model.get_input_embeddings().weight
    spec = dict(matmul_params=sum(p.numel() for p in model.model.parameters()) - embed.numel(),
                heads=cfg.num_attention_heads, layers=cfg.num_hidden_layers,
                head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    seconds = {}
    with torch.inference_mode():
        model.model(prompts[min(prompts)][:1, :1024].to(model.device))  # first-call costs
        for L, x in prompts.items():
            x = x.to(model.device)
            seconds[L] = timed(lambda: [model.model(x[i:i + 1]) for i in range(x.shape[0])])[1]
            print(f"transformers forward: {x.shape[0]} x {L}: {seconds[L]:.3f} s", flush=True)
    del model
    print(free_memory(), flush=True)
    return seconds, spec


def flexengine_prefill(args, prompts: dict[int, torch.Tensor]) -> tuple[dict[int, list[float]], float, int]:
    """{length: [seconds of run 1, run 2]} (run 2 on prompts + 1: nothing cached), build seconds, max_model_len."""
    from flexengine import SamplingParams
    from flexengine.attention.backends import prefill_kernel
    prefill_kernel.FA4_Q_TILES = args.fa4_q_tiles
    llm, built = build_llm(args)
    max_len = llm.llm_engine.max_model_len
    print(f"LLM built in {built:.1f} s; max_model_len {max_len}", flush=True)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(100, 1124))}], params, use_tqdm=False)
    seconds = {}
    for L, x in prompts.items():
        if L >= max_len:
            print(f"flexengine: {L} tokens do not fit max_model_len {max_len}; skipped", flush=True)
            continue
        seconds[L] = [timed(llm.generate, [{"prompt_token_ids": (p + k).tolist()} for p in x], params,
                            use_tqdm=False)[1] for k in (0, 1)]
        print(f"flexengine: {x.shape[0]} x {L}: {seconds[L][0]:.3f} s then {seconds[L][1]:.3f} s", flush=True)
    del llm
    print(free_memory(), flush=True)
    return seconds, built, max_len


def main(args) -> int:
    lengths = [int(n) for n in args.lengths.split(",")]
    vocab = hf_vocab_size(args.model)
    prompts = {L: torch.tensor(random_prompts(max(1, args.total_tokens // L), L, vocab - 2, args.seed + L))
               for L in lengths}
    hf, spec = ({}, None) if args.skip_transformers else transformers_prefill(args, prompts)
    fe, built, max_len = flexengine_prefill(args, prompts)
    rows = []
    for L in lengths:
        n = prompts[L].shape[0]
        row = dict(prompts=n, length=L, transformers_s=hf.get(L), flexengine_s=fe.get(L))
        if fe.get(L):
            second = fe[L][1]
            row["flexengine_tok_s"] = n * L / second
            if L in hf:
                row["transformers_over_flexengine"] = hf[L] / second
            if spec:
                row["floor_s"] = floor_seconds(spec, n, L)
                row["flexengine_over_floor"] = second / row["floor_s"]
        rows.append(row)
    print(f"\n# long-context prefill on {device_name()}, torch {torch.__version__}; flexengine max_model_len "
          f"{max_len}, built in {built:.1f} s")
    print("| prompts × length | transformers forward | flexengine (run 1, run 2) | flexengine tok/s | "
          "transformers / flexengine | floor | flexengine / floor |")
    print("|---|---|---|---|---|---|---|")
    fmt = lambda v, f: "—" if v is None else f.format(v)  # noqa: E731
    for r in rows:
        runs = "—" if r["flexengine_s"] is None else f"{r['flexengine_s'][0]:.3f} s, {r['flexengine_s'][1]:.3f} s"
        print(f"| {r['prompts']} × {r['length']:,} | {fmt(r['transformers_s'], '{:.3f} s')} | {runs} | "
              f"{fmt(r.get('flexengine_tok_s'), '{:,.0f}')} | "
              f"{fmt(r.get('transformers_over_flexengine'), '{:.2f}×')} | "
              f"{fmt(r.get('floor_s'), '{:.3f} s')} | {fmt(r.get('flexengine_over_floor'), '{:.2f}×')} |")
    result = dict(device=device_name(), torch=torch.__version__, max_model_len=max_len, build_s=built, rows=rows,
                  floor_flops=REACHABLE_FLOPS, spec=spec)
    write_json(args.json_out, result)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    main(parser.parse_args())
