"""Issues 16 / 15: the decode step with other tile options for flex's decode kernel (attention/backends/flex.py's
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

torch 2.11 gives sm90's decode template one pipeline stage, two warps and a 64-wide KV tile; the H100's batch-32
profile (session 25) had that kernel at 20 µs a layer for ~300-token contexts, where batch 8 with four splits took 8.5.
The engine now asks for three stages there (flex.default_decode_options).
"""
from __future__ import annotations

import os
import sys

KEYS = ("BLOCK_N", "num_stages", "num_warps")
ENGINE_KEYS = ("combo_up_to", "programs_per_sm", "few_rows", "rotary_store", "gate_up_rows")


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


def main() -> int:
    split = sys.argv.index("--") if "--" in sys.argv else len(sys.argv)
    options, engine = parse(",".join(sys.argv[1:split]))
    what, *args = sys.argv[split + 1:] or ["latency"]
    from flexengine.attention import layout
    from flexengine.attention.backends import flex
    from flexengine.compile import cuda_graphs
    from flexengine.layers import gemv, rotary
    flex.DECODE_OPTIONS = options
    cuda_graphs.COMBO_UP_TO = engine.get("combo_up_to", cuda_graphs.COMBO_UP_TO)
    layout.DECODE_PROGRAMS_PER_SM = engine.get("programs_per_sm", layout.DECODE_PROGRAMS_PER_SM)
    gemv.FEW_ROWS = engine.get("few_rows", gemv.FEW_ROWS)
    rotary.ROTARY_STORE = bool(engine.get("rotary_store", rotary.ROTARY_STORE))
    gemv.GATE_UP_ROWS = engine.get("gate_up_rows", gemv.GATE_UP_ROWS)
    if "blas" in engine:
        import torch
        torch.backends.cuda.preferred_blas_library(engine["blas"])
    print(f"# flex decode kernel options: {'the engine default' if options is None else options or 'flex default'}; "
          f"combo kernels up to batch {cuda_graphs.COMBO_UP_TO}; {layout.DECODE_PROGRAMS_PER_SM} split-KV programs per "
          f"SM; few-rows GEMV up to {gemv.FEW_ROWS} rows; rotary + K/V store kernel {rotary.ROTARY_STORE}; gate/up + "
          f"SiLU on the rows kernel up to {gemv.GATE_UP_ROWS} rows; BLAS "
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
