"""Issues 16 / 15: the decode step with other tile options for flex's decode kernel (attention/backends/flex_kernels.py's
DECODE_OPTIONS), Inductor's combo kernels up to another batch (compile/cuda_graphs.py's COMBO_UP_TO), another split-KV
target (attention/layout.py's DECODE_PROGRAMS_PER_SM), the few-rows GEMV (layers/gemv.py's FEW_ROWS), without the
rotary + K/V store kernel (layers/rotary.py's ROTARY_STORE) or with gate/up + SiLU on the few-rows kernel
(layers/gemv.py's GATE_UP_ROWS), in
`flexengine bench latency` / `bench throughput` or the attention microbenchmark:

    python3 scripts/decode_step_probe.py num_stages=3,num_warps=4 -- latency --model DIR --batch-size 32 ...
    python3 scripts/decode_step_probe.py BLOCK_N=128,num_stages=2 -- attention --decode-only
    python3 scripts/decode_step_probe.py none -- throughput ...  # flex's own tiles (the engine's before session 25)
    python3 scripts/decode_step_probe.py default,combo_up_to=32 -- latency ...  # the engine's tiles, combo to 32
    python3 scripts/decode_step_probe.py programs_per_sm=8,split_kv=kernel -- latency ...  # more split-KV programs
    python3 scripts/decode_step_probe.py few_rows=32 -- latency ...  # layers/gemv.py's rows_kernel for 2-32 rows
    python3 scripts/decode_step_probe.py default,blas=cublaslt -- latency ...  # torch's GEMMs through cuBLASLt
    python3 scripts/decode_step_probe.py default,rotary_store=0 -- latency ...  # Inductor's rotary and K/V store kernels
    python3 scripts/decode_step_probe.py default,gate_up_rows=32 -- latency ...  # gate/up + SiLU in one kernel to 32 rows
    python3 scripts/decode_step_probe.py default,persistent_up_to=4096 -- latency ...  # one-pass norms (below)
    python3 scripts/decode_step_probe.py default,head_rows=0 -- latency ...  # the LM head on cuBLAS at every batch
    python3 scripts/decode_step_probe.py default,decode_partial_rows=32 -- latency ...  # decode steps of <= 32 rows: every page partial
    python3 scripts/decode_step_probe.py default,down_split_rows=32 -- latency ...  # down's split-K summed in the norm
    python3 scripts/decode_step_probe.py default,argmax_chunks=64 -- latency ...  # greedy argmax over 64 chunks a row
    python3 scripts/decode_step_probe.py default,heads_as_rows=32 -- latency ...  # decode on flex's attention template
    python3 scripts/decode_step_probe.py default,heads_as_rows=32,heads_block_n=128,heads_num_warps=4 -- latency ...
    python3 scripts/decode_step_probe.py default,prefill_dynamic=0 -- throughput ...  # a prefill compile per bucket
    python3 scripts/decode_step_probe.py default,zero_first_deltas=0 -- latency ...  # no zero additions: the first layer's own graphs
    python3 scripts/decode_step_probe.py default,cos_sin_kernel=0 -- latency ...  # cos/sin from Inductor's kernel
    python3 scripts/decode_step_probe.py default,prefill_symbolic_first=0 -- latency ...  # two prefill graphs, no pad
    python3 scripts/decode_step_probe.py default,combo_kernels=0 -- latency ...  # FLEXENGINE_COMBO_KERNELS=0
    python3 scripts/decode_step_probe.py default,bucket_96=0,bucket_step=128 -- latency ... --max-num-seqs 256
        # no decode bucket 96 nor 192 (compile/policy.py): batch 96 runs on 128's graph, 192 on 256's
    python3 scripts/decode_step_probe.py default,plan_graphs_at_start=0 -- throughput ...  # long steps' plan graphs
        # captured when first met (compile/warmup.py's CAPTURE_PLAN_GRAPHS), not at start-up
    python3 scripts/decode_step_probe.py default,mixed_bucket_base=0 -- throughput ...  # a mixed step's decode rows
        # on every decode bucket, not on 1, 4, 16, 64, 256 alone (compile/policy.py's MIXED_DECODE_BASE, 4)

heads_as_rows=N: the decode rows of steps of up to N on flex's attention template, each KV head's query heads as its
query rows (flex_kernels.DECODE_HEADS_AS_ROWS; no normalising kernel after the decode template's float32 accumulator);
heads_block_n / heads_num_warps / heads_num_stages: that template's tile (flex_kernels.HEADS_AS_ROWS_TILES).

prefill_dynamic=0: the engine's Triton prefill call compiled per tile bucket, not once for a symbolic tile count
(flex_kernels.PREFILL_DYNAMIC; scripts/prefill_dynamic_probe.py times the kernel alone). decode_dynamic=1: every
unsplit decode row with query heads as rows, compiled once for a symbolic row count (flex_kernels.DECODE_DYNAMIC).

persistent_up_to=N: Inductor reduces rows of up to N elements in one pass (a persistent reduction) where it takes
two from 1,025 (torch's InductorChoices threshold): the decoder's residual sum + RMSNorm over a hidden size of 2,048
(4,096 at 8B) is such a two-pass kernel, 32 of them at 2.1 µs each in batch 32's step (session 37's profile). Its
compiles get a cache folder of their own (/tmp/inductor_persistent_N), so that no cached two-pass kernel stands in.

torch 2.11 gives sm90's decode template one pipeline stage, two warps and a 64-wide KV tile; the H100's batch-32
profile (session 25) had that kernel at 20 µs a layer for ~300-token contexts, where batch 8 with four splits took 8.5.
The engine now asks for three stages there (flex_kernels.default_decode_options).
"""
from __future__ import annotations

import os
import sys

KEYS = ("BLOCK_N", "num_stages", "num_warps")
ENGINE_KEYS = ("combo_up_to", "programs_per_sm", "few_rows", "rotary_store", "gate_up_rows", "persistent_up_to",
               "head_rows", "decode_partial_rows", "down_split_rows", "argmax_chunks", "heads_as_rows",
               "heads_block_n", "heads_num_warps", "heads_num_stages", "prefill_dynamic", "decode_dynamic",
               "zero_first_deltas", "cos_sin_kernel", "prefill_symbolic_first", "combo_kernels", "bucket_96",
               "bucket_step", "plan_graphs_at_start", "mixed_bucket_base")


def parse(text: str) -> tuple[dict | None, dict]:
    """→ (flex's decode tile options, None for the engine's default; the engine knobs given, of combo_up_to,
    programs_per_sm and few_rows: the others keep the modules' own values)."""
    options, engine = None, {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if item in ("none", "default"):
            options = {} if item == "none" else options
        elif key in ENGINE_KEYS and value.isdigit():
            engine[key] = int(value)
        elif key == "split_kv" and value in ("auto", "kernel", "rows"):
            os.environ["FLEXENGINE_SPLIT_KV"] = value  # (read at every layout plan)
        elif key == "blas" and value in ("cublas", "cublaslt"):
            engine[key] = value  # torch.backends.cuda.preferred_blas_library: cuBLASLt may pick GEMMs without
            # cuBLAS's separate split-K reduction kernel (30 µs of batch 32's step, session 25's profile)
        elif key in KEYS and value.isdigit():
            options = {**(options or {}), key: int(value)}
        else:
            raise SystemExit(f"bad option {item!r}: none, default, split_kv=auto|kernel|rows, KEY=INT with KEY one "
                             f"of {KEYS + ENGINE_KEYS}, blas=cublas|cublaslt")
    return options, engine


def persistent_reductions_up_to(n: int) -> None:
    """Inductor's inner reductions of up to n elements in one pass, for compiles in this process (see the top)."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"/tmp/inductor_persistent_{n}"  # (the engine keeps a set one)
    import torch._inductor.config as inductor_config
    from torch._inductor.choices import InductorChoices
    from torch._inductor.runtime.hints import ReductionHint
    from torch._inductor.virtualized import V

    class PersistentUpTo(InductorChoices):
        @staticmethod
        def should_use_persistent_reduction(features, cooperative_reduction):
            if (features.get_reduction_hint() == ReductionHint.INNER
                    and V.graph.sizevars.statically_known_leq(features.reduction_numel, n)):
                return True
            return InductorChoices.should_use_persistent_reduction(features, cooperative_reduction)

    if hasattr(inductor_config, "inductor_choices_class"):
        inductor_config.inductor_choices_class = PersistentUpTo  # every thread's compiles
    else:  # an older Inductor: this thread's (the engine compiles its warm-up on the caller's)
        V.set_choices_handler(PersistentUpTo())


def apply(options: dict | None, engine: dict) -> None:
    """Set parse's flex decode options and engine knobs in their modules (scripts/startup_time.py --knobs too)."""
    from flexengine.attention import layout, metadata
    from flexengine.attention.backends import flex_kernels
    from flexengine.compile import cuda_graphs
    from flexengine.layers import gemv, linear, rotary, sampler
    flex_kernels.DECODE_OPTIONS = options
    cuda_graphs.COMBO_UP_TO = engine.get("combo_up_to", cuda_graphs.COMBO_UP_TO)
    layout.DECODE_PROGRAMS_PER_SM = engine.get("programs_per_sm", layout.DECODE_PROGRAMS_PER_SM)
    gemv.FEW_ROWS = engine.get("few_rows", gemv.FEW_ROWS)
    rotary.ROTARY_STORE = bool(engine.get("rotary_store", rotary.ROTARY_STORE))
    gemv.GATE_UP_ROWS = engine.get("gate_up_rows", gemv.GATE_UP_ROWS)
    gemv.HEAD_ROWS = engine.get("head_rows", gemv.HEAD_ROWS)
    metadata.DECODE_PARTIAL_ROWS = engine.get("decode_partial_rows", metadata.DECODE_PARTIAL_ROWS)
    linear.DOWN_SPLIT_ROWS = engine.get("down_split_rows", linear.DOWN_SPLIT_ROWS)
    flex_kernels.DECODE_HEADS_AS_ROWS = engine.get("heads_as_rows", flex_kernels.DECODE_HEADS_AS_ROWS)
    flex_kernels.PREFILL_DYNAMIC = bool(engine.get("prefill_dynamic", flex_kernels.PREFILL_DYNAMIC))
    flex_kernels.DECODE_DYNAMIC = bool(engine.get("decode_dynamic", flex_kernels.DECODE_DYNAMIC))
    flex_kernels.PREFILL_SYMBOLIC_FIRST = bool(engine.get("prefill_symbolic_first",
                                                          flex_kernels.PREFILL_SYMBOLIC_FIRST))
    from flexengine.models import decoder
    decoder.ZERO_FIRST_DELTAS = bool(engine.get("zero_first_deltas", decoder.ZERO_FIRST_DELTAS))
    rotary.COS_SIN_KERNEL = bool(engine.get("cos_sin_kernel", rotary.COS_SIN_KERNEL))
    from flexengine.compile import policy, warmup
    policy.DECODE_BUCKET_96 = bool(engine.get("bucket_96", policy.DECODE_BUCKET_96))
    policy.DECODE_BUCKET_STEP = engine.get("bucket_step", policy.DECODE_BUCKET_STEP)
    warmup.CAPTURE_PLAN_GRAPHS = bool(engine.get("plan_graphs_at_start", warmup.CAPTURE_PLAN_GRAPHS))
    policy.MIXED_DECODE_BASE = engine.get("mixed_bucket_base", policy.MIXED_DECODE_BASE) or None  # (0: every bucket)
    if "combo_kernels" in engine:  # FLEXENGINE_COMBO_KERNELS: the step helpers' and the batch-1 regions' (read at use)
        from flexengine.config import COMBO_KERNELS_ENV
        os.environ[COMBO_KERNELS_ENV] = str(int(bool(engine["combo_kernels"])))
    tiles = {k[len("heads_"):].replace("block_n", "BLOCK_N"): v for k, v in engine.items()
             if k.startswith("heads_") and k != "heads_as_rows"}
    flex_kernels.HEADS_AS_ROWS_TILES = {**flex_kernels.HEADS_AS_ROWS_TILES, **tiles}
    if "argmax_chunks" in engine:  # (that many chunks first, then the smaller defaults)
        sampler.ARGMAX_CHUNKS = (engine["argmax_chunks"],) + tuple(c for c in sampler.ARGMAX_CHUNKS
                                                                    if c < engine["argmax_chunks"])
    if "persistent_up_to" in engine:
        persistent_reductions_up_to(engine["persistent_up_to"])
    if "blas" in engine:
        import torch
        torch.backends.cuda.preferred_blas_library(engine["blas"])


def main() -> int:
    split = sys.argv.index("--") if "--" in sys.argv else len(sys.argv)
    options, engine = parse(",".join(sys.argv[1:split]))
    what, *args = sys.argv[split + 1:] or ["latency"]
    apply(options, engine)
    from flexengine.attention import layout, metadata
    from flexengine.attention.backends import flex_kernels
    from flexengine.compile import cuda_graphs
    from flexengine.layers import gemv, linear, rotary, sampler
    print(f"# flex decode kernel options: {'the engine default' if options is None else options or 'flex default'}; "
          f"combo kernels up to batch {cuda_graphs.COMBO_UP_TO}; {layout.DECODE_PROGRAMS_PER_SM} split-KV programs per "
          f"SM; few-rows GEMV up to {gemv.FEW_ROWS} rows; rotary + K/V store kernel {rotary.ROTARY_STORE}; gate/up + "
          f"SiLU on the rows kernel up to {gemv.GATE_UP_ROWS} rows; the LM head on it up to {gemv.HEAD_ROWS} rows; "
          f"every decode page partial up to {metadata.DECODE_PARTIAL_ROWS} rows; down's split-K partial sums up to "
          f"{linear.DOWN_SPLIT_ROWS} rows; decode on the attention template, query heads as rows, up to "
          f"{flex_kernels.DECODE_HEADS_AS_ROWS} rows (tiles {flex_kernels.HEADS_AS_ROWS_TILES}); prefill compiled "
          f"for a symbolic tile count {flex_kernels.PREFILL_DYNAMIC}, decode rows for a symbolic row count "
          f"{flex_kernels.DECODE_DYNAMIC}; argmax chunks "
          f"{sampler.ARGMAX_CHUNKS}; persistent reductions up to "
          f"{engine.get('persistent_up_to', 'torch default')}; BLAS "
          f"{engine.get('blas', 'torch default')}", flush=True)
    if what == "attention":
        import argparse
        from flexengine.benchmarks import attention
        parser = argparse.ArgumentParser()
        attention.add_arguments(parser)
        return attention.main(parser.parse_args(args))
    if what not in ("latency", "throughput"):
        raise SystemExit(f"run 'latency', 'throughput' or 'attention', not {what!r}")
    from flexengine.cli import main as cli
    return cli(["bench", what, *args])


if __name__ == "__main__":
    sys.exit(main())
