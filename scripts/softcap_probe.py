"""What a softcap score mod costs in flex's FA4 prefill, and why (issue 15: window + softcap within 15% of causal).

    python3 scripts/softcap_probe.py [--page 16] [--tanh engine|strict|fastmath|approx|f16x2] [--rows 8x1024,32x512]
        [--variants none,softcap,mul,half] [--fa4 mma_pv_is_rs=0,intra_wg_overlap=0,pack_gqa=0] [--no-error] [--mapped]
        [--native]

Times the attention benchmark's paged prefill rows (its own `flex_times`, a CUDA graph of the call) with
sliding_window(1024) and these score mods, in this order:
  none        no score mod
  softcap     masks.softcap(30): cap * tanh(score / cap)
  mul         cap * tanh(score * (1 / cap)): a multiply instead of a division
  half        score * 0.5: a score mod without tanh
--tanh picks how torch's CuTe lowering writes tanh into FA4's score mod: `engine` (what the engine sets,
prefill_kernel.use_fast_tanh), `strict` (torch's own math.tanh), `fastmath` (cute.math.tanh(fastmath=True), as FA4's
own softcap), `approx` (cute_tanh.tanh_approx: PTX tanh.approx.f32 per element), `f16x2` (cute_tanh.tanh_f16x2: two
elements per tanh.approx.f16x2). Each lowering writes other code,
so FA4 compiles its own kernel for it (its compile cache keys on the code; Inductor's caches are turned off).
--fa4 sets FA4's launch options for the calls that carry a score mod; --mapped runs every score mod through
paged_score's mapping to logical coordinates (the engine skips it for a mod that reads none since session 32).
--native adds FA4's own entry point (flash_attn_func on contiguous batches, its causal, window_size and softcap
arguments, no flex): what FlashAttention-4's built-in softcap costs against its own causal call.
Session 32's rows: docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import functools

import torch

from flexengine import masks
from flexengine.attention.backends import prefill_kernel
from flexengine.benchmarks.attention import flex_times, sdpa_prefill


def softcap_mul(cap: float):
    inv = 1.0 / cap

    def softcap_mul_score(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score * inv)
    return softcap_mul_score


TANH_FORMS = {"strict": "cute.math.tanh({x})", "fastmath": prefill_kernel.FAST_TANH,
              "approx": '__import__("cute_tanh").tanh_approx({x})', "f16x2": '__import__("cute_tanh").tanh_f16x2({x})'}


def half_score(score, b, h, q_idx, kv_idx):
    """A score mod with no special function: what the score-mod path costs by itself."""
    return score * 0.5


def patch_cute_tanh(form: str) -> str:
    """Switch torch's CuTe DSL lowering of tanh to `form` (after the engine's own switch, so this one stays); returns
    the lowering's template."""
    engine = prefill_kernel.FAST_TANH if prefill_kernel.use_fast_tanh() else "torch's own (strict)"
    if form == "engine":
        return engine
    # Inductor's caches key on the graph, not on the lowering: a cached kernel would be the other form's
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    assert prefill_kernel.lower_tanh_as(TANH_FORMS[form]), "this torch has no CuTe DSL tanh lowering"
    return TANH_FORMS[form]


def softcap_error(dev, cap: float = 30.0, L: int = 1024, H: int = 8, D: int = 128) -> tuple[float, float]:
    """Max |FA4 flex - float64 reference| of causal attention with softcap(cap), bf16 inputs scaled so that scores
    reach the cap's range; and the same for flex's bf16 output of the plain causal call (the noise floor)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from flexengine.attention.backends.prefill_kernel import FLASH_OPTIONS
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(1, H, L, D, device=dev, generator=g).mul(2.0).to(torch.bfloat16) for _ in range(3))
    block_mask = create_block_mask(lambda b, h, qi, ki: ki <= qi, 1, 1, L, L, device=dev)
    flex = torch.compile(flex_attention, dynamic=False, fullgraph=True)  # (FA4 takes no symbolic scalar)
    errors = []
    for score in (masks.softcap(cap), None):
        out = flex(q, k, v, score_mod=score, block_mask=block_mask, kernel_options=dict(FLASH_OPTIONS))
        s = (q.double() @ k.double().transpose(-1, -2)) * D ** -0.5
        if score is not None:
            s = cap * torch.tanh(s / cap)
        s = s.masked_fill(torch.ones(L, L, dtype=torch.bool, device=dev).triu(1), float("-inf"))
        errors.append(float((out.double() - s.softmax(-1) @ v.double()).abs().max()))
    return errors[0], errors[1]


def native_fa4_rows(rows, Hq: int, Hkv: int, D: int, dev) -> None:
    """FA4's flash_attn_func on contiguous [n, L, heads, D] batches, each call replayed from a CUDA graph."""
    from flash_attn.cute.interface import flash_attn_func

    from flexengine.benchmarks.attention import bench
    cases = [("causal", {}), ("window(1024)", {"window_size": (1023, 0)}), ("softcap(30)", {"softcap": 30.0}),
             ("window + softcap", {"window_size": (1023, 0), "softcap": 30.0})]
    tensors = {(n, L): [torch.randn(n, L, h, D, device=dev, dtype=torch.bfloat16) for h in (Hq, Hkv, Hkv)]
               for n, L in rows}
    for name, kwargs in cases:
        cells = []
        for n, L in rows:
            q, k, v = tensors[(n, L)]
            call = lambda: flash_attn_func(q, k, v, causal=True, **kwargs)  # noqa: E731
            call()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                call()
            cells.append(f"{bench(graph.replay):.0f}")
        print(f"| FA4's own, {name} | " + " | ".join(cells) + " |", flush=True)


def patch_fa4_score_mod_calls(options: dict) -> None:
    """FA4's launch options (its _flash_attn_fwd keywords: mma_pv_is_rs, intra_wg_overlap, pack_gqa) for the calls
    that carry a score mod; the others keep FA4's own choice."""
    from flash_attn.cute import interface
    fwd = interface._flash_attn_fwd

    @functools.wraps(fwd)  # (with its attributes: Inductor's call reads fwd.compile_cache)
    def patched(*args, **kwargs):
        if kwargs.get("score_mod") is not None:
            kwargs.update(options)
        return fwd(*args, **kwargs)
    interface._flash_attn_fwd = patched


def parse_fa4_options(text: str) -> dict:
    """'mma_pv_is_rs=0,pack_gqa=1' -> {'mma_pv_is_rs': False, 'pack_gqa': True}"""
    pairs = (item.split("=") for item in text.split(",") if item)
    return {key: bool(int(value)) for key, value in pairs}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--tanh", default="engine", choices=["engine", "strict", "fastmath", "approx", "f16x2"])
    p.add_argument("--rows", default="8x1024,32x512", help="prefill cases, requests x length")
    p.add_argument("--fa4", default="", help="FA4 launch options for the score-mod calls, e.g. intra_wg_overlap=0")
    p.add_argument("--variants", default="none,softcap,mul,half", help="which score mods to time (with the window)")
    p.add_argument("--no-error", action="store_true", help="skip the softcap's error against float64")
    p.add_argument("--native", action="store_true", help="also FA4's own flash_attn_func: causal, window, softcap")
    p.add_argument("--mapped", action="store_true", help="every score mod through paged_score's coordinate mapping, "
                   "as before session 32 (its kernel captures the step's tables)")
    args = p.parse_args()
    dev = torch.device("cuda")
    if args.mapped:
        from flexengine.attention.backends import paged_mods
        paged_mods.reads_coordinates = lambda score_mod: True
        print("# score mods mapped to logical coordinates (paged_score's wrapper), as before session 32")
    if args.fa4:
        patch_fa4_score_mod_calls(parse_fa4_options(args.fa4))
        print(f"# FA4 options for score-mod calls: {parse_fa4_options(args.fa4)}")
    print(f"# tanh {args.tanh}: " + patch_cute_tanh(args.tanh).replace("\n", "\n# "))
    Hq, Hkv, D = 32, 8, 128
    window = masks.sliding_window(1024)
    variants = [("none", None), ("softcap", masks.softcap(30.0)), ("mul", softcap_mul(30.0)), ("half", half_score)]
    rows = [tuple(int(v) for v in case.split("x")) for case in args.rows.split(",")]
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} page {args.page}; µs per call (kernel graph)")
    print("| variant | " + " | ".join(f"{n}x{L}" for n, L in rows) + " |")
    print("|---|" + "---|" * len(rows))
    print("| SDPA causal | " + " | ".join(f"{sdpa_prefill(n, L, Hq, Hkv, D, dev):.0f}" for n, L in rows) + " |")
    causal = masks.get_mask_mod("causal")
    print("| causal, none | " + " | ".join(
        f"{flex_times([L] * n, [L] * n, args.page, Hq, Hkv, D, dev, (causal, None))[0]:.0f}" for n, L in rows) + " |")
    for name, score in (v for v in variants if v[0] in args.variants.split(",")):
        cells = [f"{flex_times([L] * n, [L] * n, args.page, Hq, Hkv, D, dev, (window, score))[0]:.0f}"
                 for n, L in rows]
        print(f"| window, {name} | " + " | ".join(cells) + " |", flush=True)
    if args.native:
        native_fa4_rows(rows, Hq, Hkv, D, dev)
    if args.no_error:
        return
    capped, plain = softcap_error(dev)
    print(f"# max |out - float64 reference|, 1 x 8 heads x 1024, causal: softcap(30) {capped:.2e}, no score mod {plain:.2e}")


if __name__ == "__main__":
    main()
