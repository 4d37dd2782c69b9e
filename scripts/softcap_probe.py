"""What a softcap score mod costs in flex's FA4 prefill, and why (issue 15: window + softcap within 15% of causal).

    python3 scripts/softcap_probe.py [--page 16]

Times the attention benchmark's paged prefill rows (its own `flex_times`, a CUDA graph of the call) with
sliding_window(1024) and these score mods, in this order:
  none        no score mod
  softcap     masks.softcap(30): cap * tanh(score / cap)
  mul         cap * tanh(score * (1 / cap)): a multiply instead of a division
With --patch, torch's CuTe lowering of tanh is first switched to cute.math.tanh(fastmath=True) (FA4's own
softcap uses that; torch emits the strict math.tanh), with Inductor's caches off so nothing compiled before
is reused. Run it once without and once with --patch.
"""
from __future__ import annotations

import argparse
import inspect

import torch

from flexengine import masks
from flexengine.benchmarks.attention import flex_times, sdpa_prefill


def softcap_mul(cap: float):
    inv = 1.0 / cap

    def softcap_mul_score(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score * inv)
    return softcap_mul_score


def patch_cute_tanh() -> str:
    """Switch torch's CuTe DSL lowering of tanh to the fast-math form; returns what it was."""
    from torch._inductor.codegen.cutedsl.cutedsl_op_overrides import CuteDSLOpOverrides
    before = inspect.getsource(CuteDSLOpOverrides.tanh)

    def tanh(x0):
        return CuteDSLOpOverrides._apply_unary_op(x0, "cute.math.tanh({x}, fastmath=True)")
    CuteDSLOpOverrides.tanh = staticmethod(tanh)
    return before


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--patch", action="store_true")
    args = p.parse_args()
    dev = torch.device("cuda")
    if args.patch:
        torch._inductor.config.fx_graph_cache = False
        print("# patched torch's CuTe tanh; it was:\n# " + patch_cute_tanh().replace("\n", "\n# "))
    Hq, Hkv, D = 32, 8, 128
    window = masks.sliding_window(1024)
    variants = [("none", None), ("softcap", masks.softcap(30.0)), ("mul", softcap_mul(30.0))]
    rows = [(8, 1024), (32, 512)]
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} page {args.page}; µs per call (kernel graph)")
    print("| variant | " + " | ".join(f"{n}x{L}" for n, L in rows) + " |")
    print("|---|" + "---|" * len(rows))
    print("| SDPA causal | " + " | ".join(f"{sdpa_prefill(n, L, Hq, Hkv, D, dev):.0f}" for n, L in rows) + " |")
    causal = masks.get_mask_mod("causal")
    print("| causal, none | " + " | ".join(
        f"{flex_times([L] * n, [L] * n, args.page, Hq, Hkv, D, dev, (causal, None))[0]:.0f}" for n, L in rows) + " |")
    for name, score in variants:
        cells = [f"{flex_times([L] * n, [L] * n, args.page, Hq, Hkv, D, dev, (window, score))[0]:.0f}"
                 for n, L in rows]
        print(f"| window, {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
