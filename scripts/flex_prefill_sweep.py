"""Kernel options of the compiled flex prefill call, on a GPU box: each option set against the template's
defaults and SDPA flash, on the engine's long-prompt shapes (a 2,048-token chunk over a long cached
prefix, one whole long prompt) and one row of DESIGN.md's attention table. Results print as they come.

    python3 scripts/flex_prefill_sweep.py [--configs default,warps8,...] [--cases ...]

The chunk rows' SDPA baseline attends the whole rectangle (non-causal, q 2,048 x k ctx): 3% more work
than the chunk's trapezoid at 32k, so its ratio slightly favours flex.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch._dynamo
import torch.nn.functional as F

from flexengine.attention.backends import prefill_kernel
from flexengine.benchmarks.attention import bench, flex_times, parse_mods

CONFIGS = {
    "engine": None,  # the engine's choice (attention/backends/prefill_kernel.py; FLEXENGINE_FLEX_PREFILL)
    "default": {},  # the Triton template's defaults
    "warps8": {"num_warps": 8},
    "stages2": {"num_stages": 2},
    "stages4": {"num_stages": 4},
    "stages1": {"num_stages": 1},
    "warps8_stages2": {"num_warps": 8, "num_stages": 2},
    "tma": {"USE_TMA": True},
    "m128n64w8": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8},
    "safe_rows": {"ROWS_GUARANTEED_SAFE": True},
    "fa4": {"BACKEND": "FLASH"},
}
# name: (Hq, Hkv, D, query_lens, seq_lens)
CASES = {
    "d64_chunk2048_ctx32k": (32, 8, 64, [2048], [32768]),
    "d64_1x16k": (32, 8, 64, [16384], [16384]),
    "d64_8x1024": (32, 8, 64, [1024] * 8, [1024] * 8),
    "d128_2x4096": (32, 8, 128, [4096] * 2, [4096] * 2),
    "d128_chunk2048_ctx32k": (32, 8, 128, [2048], [32768]),
}


def sdpa_time(Hq, Hkv, D, query_lens, seq_lens) -> float:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    N, q_len, k_len = len(query_lens), query_lens[0], seq_lens[0]
    q = torch.randn(N, Hq, q_len, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(N, Hkv, k_len, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=q_len == k_len, enable_gqa=True))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    mods = parse_mods("causal", None, 32)
    results = []
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | causal, page {args.page} | µs (median)",
          flush=True)
    for case in args.cases.split(","):
        Hq, Hkv, D, ql, sl = CASES[case]
        base = sdpa_time(Hq, Hkv, D, ql, sl)
        print(f"{case}: SDPA flash {base:.0f} µs", flush=True)
        for name in args.configs.split(","):
            torch._dynamo.reset()
            prefill_kernel.PREFILL_KERNEL_OPTIONS = CONFIGS[name]
            try:
                us, _ = flex_times(sl, ql, args.page, Hq, Hkv, D, torch.device("cuda"), mods)
            except Exception as e:  # an option this torch or GPU cannot take: reported, and the sweep goes on
                print(f"  {name}: failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
                results.append(dict(case=case, config=name, error=repr(e)[:500]))
                continue
            print(f"  {name}: {us:.0f} µs = {base / us:.2f}x SDPA", flush=True)
            results.append(dict(case=case, config=name, flex_us=us, sdpa_us=base))
    if args.json:
        json.dump(results, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
