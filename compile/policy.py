"""How flexengine uses torch.compile: static shapes per bucket, a deliberate recompile budget, and a
hard error (never a silent eager fallback) when the budget runs out."""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging

import torch
import torch._dynamo

from ..config import env_combo_kernels, env_pdl

logger = logging.getLogger(__name__)

# Each shape class (decode batch bucket, prefill tile bucket, pool size) is one compiled graph. An
# engine warms up O(20) classes; 64 leaves room for the model and the builder without hiding a leak.
RECOMPILE_LIMIT = 64


def configure_dynamo(limit: int = RECOMPILE_LIMIT) -> None:
    """Raise dynamo's recompile limit to at least `limit` and make hitting it an error.

    Past the limit dynamo would otherwise run FlexAttention eagerly, materialising every score
    (DESIGN.md: 84 ms instead of 0.27 ms), with only a log line to show for it.
    """
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), limit))
    if hasattr(cfg, "accumulated_recompile_limit"):
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 16 * RECOMPILE_LIMIT)
    if hasattr(cfg, "fail_on_recompile_limit_hit"):
        cfg.fail_on_recompile_limit_hit = True


def start_compile_workers() -> None:
    """Start Inductor's pool of Triton compile workers now, before the weights load. Inductor starts it at its first
    compile, and until the workers have imported torch it compiles every kernel in the main process, one after
    another: 8-9 kernels of the KV sizing step, 2.3-3.5 s of a fresh H200 start (docs/benchmarks.md, session 49)."""
    from torch._inductor.async_compile import AsyncCompile, maybe_warm_pool
    maybe_warm_pool()
    AsyncCompile.use_process_pool()  # submits the job whose completion says the workers are up


def unoptimised_launcher_builds() -> None:
    """Have Triton build its C modules (each kernel signature's launcher) with -O0. Every Inductor kernel with PDL's
    launch attribute takes a launcher of its own signature's, built by the C compiler in the main thread: 42-51 builds,
    12.6-18.1 s of a fresh start on an H200 box (session 50). Of a build's 0.33 s (median, dev CPU) 0.13 s is reading
    Python.h and cuda.h and most of the rest -O3's code generation (-O0: 0.20 s). The launcher is argument glue around
    cuLaunchKernelEx, and CUDA graphs replay kernels without it. Triton appends a build's extra flags after its
    own -O3, and the last -O counts. Left alone where the user set Triton's knobs.build.impl."""
    import triton.runtime.build as build
    from triton import knobs
    if knobs.build.impl is not None or getattr(build._build, "unoptimised", False):
        return
    original = build._build

    @functools.wraps(original)
    def _build(*args, **kwargs):  # (name, src, srcdir, library_dirs, include_dirs, libraries, ccflags, ...)
        if len(args) >= 7 and isinstance(args[6], list):
            args = (*args[:6], [*args[6], "-O0"], *args[7:])
        elif isinstance(kwargs.get("ccflags"), list):
            kwargs["ccflags"] = [*kwargs["ccflags"], "-O0"]
        else:
            _report_unknown_build_call()
        return original(*args, **kwargs)

    _build.unoptimised = True
    build._build = _build


@functools.cache
def _report_unknown_build_call() -> None:
    logger.warning("Triton's C builds take their flags differently in triton %s: its launchers build with -O3 (slower "
                   "fresh starts, same speed after)", __import__("triton").__version__)


def allow_recompiles(expected: int) -> None:
    """Make room for an engine's `expected` compiled shapes of one function (flex: a graph per bucket
    and mask), plus RECOMPILE_LIMIT of slack; the limit stays an error past that."""
    configure_dynamo(expected + RECOMPILE_LIMIT)


def compile_count() -> int:
    """Graphs dynamo has compiled so far in this process (a recompile adds one)."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


# The decode buckets between the powers of two (decode_buckets): 96, and past 128 one every DECODE_BUCKET_STEP rows.
# Each bucket is a flex compile, a decode graph and a prompt-step graph per tile bucket at a fresh start; a step of
# 65-96 rows on the 128 bucket pads its GEMMs (weight-bound there) and attends nothing on the padded rows, one of
# 129-192 on the 256 bucket adds GEMM work where it starts to count. Knobs for a same-box A/B of both (issue 24;
# scripts/decode_step_probe.py bucket_96=0, bucket_step=128).
DECODE_BUCKET_96 = True
DECODE_BUCKET_STEP = 64


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Decode batch sizes that get a compiled kernel and a CUDA graph: powers of two to 64, multiples of 32
    to 128, then of 64. Each costs a flex compile at start-up (about 1.6 s on the H100 with a cold Inductor
    cache: 20 buckets of 16 took 32-43 s of a 70 s start), while padding a decode step's rows costs little
    (the GEMMs read the weights once whatever the rows; padded rows attend nothing)."""
    sizes = [1, 2, 4, 8, 16, 32, 64] + [96] * DECODE_BUCKET_96 + [128]
    sizes += list(range(128 + DECODE_BUCKET_STEP, max_num_seqs, DECODE_BUCKET_STEP))
    return [b for b in sizes if b < max_num_seqs] + [max_num_seqs]


# The decode rows of a step with prompt tokens (a mixed step) padded to the decode buckets that are powers of this base
# (and the largest); None: to every decode bucket. Each decode bucket a mixed step takes is a prompt-step graph per
# tile bucket at start-up (10-11 each at the default budget, ~130 in all). A padded decode row there has no token
# row (no GEMM work) and attends nothing, but a step of few decode rows on a larger bucket splits each row's pages
# fewer times (choose_decode_splits: the programs go to the padded rows' empty splits). 4 (66 graphs where every bucket
# gave 130) saved ~2.5 s of a fresh start on an H200 and cost 0.3% of 8 x 16k-token prompts' throughput, none at
# 256 x 256 x 256 (docs/benchmarks.md, session 56; decode_step_probe.py's mixed_bucket_base=0 is every bucket).
MIXED_DECODE_BASE: int | None = 4


def mixed_decode_buckets(max_num_seqs: int) -> list[int]:
    """The decode buckets (decode_buckets) that a mixed step's decode rows are padded to (MIXED_DECODE_BASE)."""
    buckets = decode_buckets(max_num_seqs)
    if MIXED_DECODE_BASE is None:
        return buckets
    assert MIXED_DECODE_BASE >= 2, MIXED_DECODE_BASE
    powers, p = set(), 1
    while p <= max_num_seqs:
        powers.add(p)
        p *= MIXED_DECODE_BASE
    return [b for b in buckets if b in powers or b == buckets[-1]]


def bucket(n: int, buckets: list[int]) -> int:
    """The smallest bucket holding n (n itself past the largest)."""
    return next((b for b in buckets if b >= n), n)


TILE_STEP = 8  # past 16 prefill tiles, buckets are multiples of this many (1,024 tokens)


def tile_bucket(n: int) -> int:
    """Prefill tiles (of 128 tokens) padded to a compiled bucket: a power of two up to 16, then a multiple
    of TILE_STEP. The engine pads its token buffer to the bucket, so every padded row also runs through
    the model's linear layers: past 16 tiles a step wastes at most 1,023 tokens, where powers of two
    wasted up to half of it; a full 8,192-token step needs no padding."""
    if n <= 16:
        return 0 if n == 0 else 1 << (n - 1).bit_length()
    return -(-n // TILE_STEP) * TILE_STEP


def tile_buckets(top: int) -> list[int]:
    """Every tile bucket up to the one holding `top` tiles."""
    out, n = [], 1
    while not out or out[-1] < tile_bucket(top):
        out.append(tile_bucket(n))
        n = out[-1] + 1
    return out


# Contexts (tokens before a chunk) from which a prefill step takes the backend's wide q blocks (FA4's 192-row tiles:
# attention/backends/prefill_kernel.fa4_q_tiles). A wide block's diagonal pages are all partial, the paged mask then
# runs on three times the keys: on the H100 at head size 64, 2 x 4,096 prompts ran 391 -> 579 µs, while the kernel
# over a 16,384- and a 65,536-token context gained 14% and 9% in TFLOP/s (docs/benchmarks.md, session 30).
WIDE_Q_MIN_CONTEXT = 16384


def wide_q_tiles(wide: int, query_lens, seq_lens, tiles: int, top_tiles: int) -> int:
    """Prefill tiles per q block of a step of `tiles` (a bucket) whose requests have these query and sequence
    lengths (numpy): `wide` where the step fills the largest bucket, `top_tiles`, and every prefilling request
    reads at least WIDE_Q_MIN_CONTEXT tokens before its chunk (the later chunks of a long prompt); else 1. Only
    the largest bucket, so that one compile per mask more covers them (compile/warmup.py)."""
    pre = query_lens > 1
    if wide == 1 or tiles != top_tiles or not pre.any():
        return 1
    return wide if int((seq_lens[pre] - query_lens[pre]).min()) >= WIDE_Q_MIN_CONTEXT else 1


_FUSE = {"enabled": False, "combo": False}
_FUSED: list = []  # every `fused` wrapper, for reset_fused


def set_fused_elementwise(enabled: bool) -> None:
    """Turn the `fused` functions' compiled versions on (the CUDA engine) or off (eager, CPU)."""
    _FUSE["enabled"] = enabled


@contextlib.contextmanager
def _fuse_setting(key: str, value: bool):
    before = _FUSE[key]
    _FUSE[key] = value
    try:
        yield
    finally:
        _FUSE[key] = before


def fused_elementwise(enabled: bool):
    """`set_fused_elementwise` for the calls inside; each engine's steps run under its own setting."""
    return _fuse_setting("enabled", enabled)


def decode_regions(enabled: bool = True):
    """The `fused` calls inside are a one-row decode step's (launch-bound): their compiled version has Inductor's
    combo kernels (FLEXENGINE_COMBO_KERNELS), which launch a region's data-independent kernels as one. Dynamo
    compiles one-row calls on their own anyway (it specialises size 1), so the layers add no compile; steps with
    prompt tokens keep separate kernels (combo kernels made 8k-64k prefill 1.5-4% slower, session 19)."""
    return _fuse_setting("combo", enabled and env_combo_kernels())


def reset_fused() -> None:
    """Drop the `fused` functions' compiled versions; the next call compiles again (with whatever
    torch.compile is then: tests swap in other backends)."""
    for wrapper in _FUSED:
        wrapper.compiled = {}


def pdl_options() -> dict:
    """Inductor options for FLEXENGINE_PDL=on (programmatic dependent launch of its Triton kernels; Inductor
    itself generates none below sm90); empty when off, or where this torch has no such option."""
    return {"triton.enable_pdl": True} if env_pdl() and _inductor_has_pdl() else {}


@functools.cache
def _inductor_has_pdl() -> bool:
    """Whether this torch's Inductor has triton.enable_pdl; False said once."""
    import torch._inductor.config as inductor_config
    if hasattr(inductor_config.triton, "enable_pdl"):
        return True
    logger.warning("FLEXENGINE_PDL=on: torch %s's Inductor has no triton.enable_pdl; its kernels launch without "
                   "PDL (the one-row GEMVs still use it)", torch.__version__)
    return False


def compile_region(fn, combo: bool, autotune_pointwise: bool = True, pdl: bool = True):
    """torch.compile as the engine's regions use it: dynamic shapes, one graph; with `combo`, Inductor's combo
    kernels; without `autotune_pointwise`, one config per pointwise kernel (see `fused`); with `pdl`,
    FLEXENGINE_PDL's option (see `compiled_on_first_use`)."""
    configure_dynamo()
    options = {"triton.autotune_pointwise": autotune_pointwise, **(pdl_options() if pdl else {})}
    if combo:
        options["combo_kernels"] = True
    return torch.compile(fn, dynamic=True, fullgraph=True, options=options)


def fused(fn=None, *, writes_kv_cache: bool = False, static_vocab: bool = False, autotune: bool = True):
    """Mark a pure step (a norm, rotary, an activation, a layer's work beside attention) for Inductor.

    Compiled with dynamic shapes, so every layer and every batch size shares the code (a module passed
    as `self` is inlined: its parameters are inputs, not constants), once for the batch-1 decode graph
    (`decode_regions`) and once for the rest; inside a compiled region the plain function is traced instead.
    Off unless the engine turns it on.

    `writes_kv_cache`: the step stores into the paged cache (its `k_cache` and `v_cache` arguments) in place.
    Inductor times two configs of each new pointwise kernel on its first run, saving and restoring a mutated input
    around each timed run, in host memory when a copy does not fit beside a cache that fills the GPU: ~6 s of a cold
    start-up on the H100 (session 20). Such a step's pointwise kernels take Inductor's default config instead.
    The caches' page size, heads and head size are compiled as constants (only the page count stays dynamic):
    dynamic ones made the store kernel find each element's page, head and lane by 64-bit division at run time.

    `static_vocab`: the first argument's last dimension (the sampler's logits: the vocabulary, one size per engine)
    is compiled as a constant. A dynamic one makes every pointwise kernel over [rows, vocab] divide each element's
    index by it at run time, in 64-bit integers: the token mask's kernel took 395 µs at 256 rows of a 128k
    vocabulary on the H100 (session 21).

    `autotune=False`: one config per pointwise kernel, for a step too small for the configs to differ.
    """
    if fn is None:
        return functools.partial(fused, writes_kv_cache=writes_kv_cache, static_vocab=static_vocab, autotune=autotune)

    names = list(inspect.signature(fn).parameters)
    caches = [(names.index(name), name) for name in ("k_cache", "v_cache")] if writes_kv_cache else []

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not _FUSE["enabled"] or torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        if static_vocab:
            torch._dynamo.mark_static(args[0], args[0].dim() - 1)
        for i, name in caches:
            mark_page_shape_static(args[i] if i < len(args) else kwargs[name])
        combo = _FUSE["combo"]
        if combo not in wrapper.compiled:
            wrapper.compiled[combo] = compile_region(fn, combo, autotune_pointwise=autotune and not writes_kv_cache)
        return wrapper.compiled[combo](*args, **kwargs)

    wrapper.eager, wrapper.compiled = fn, {}
    _FUSED.append(wrapper)
    return wrapper


def mark_page_shape_static(cache: torch.Tensor) -> None:
    """Mark a paged cache's dims past the page count static for dynamo, once per tensor: mark_static costs ~0.7 µs a
    dimension, and an eager step calls every layer's region (~70 µs a step over 16 layers)."""
    if not getattr(cache, "_flexengine_static_pages", False):
        for d in range(1, cache.dim()):
            torch._dynamo.mark_static(cache, d)
        cache._flexengine_static_pages = True


def compiled_on_first_use(fn, pdl: bool = True):
    """→ a function returning fn compiled by `compile_region`, made once, on its first call (the device-side step
    helpers the CUDA engine runs through Inductor, whatever the `fused` setting: small integer work, combo kernels
    unless FLEXENGINE_COMBO_KERNELS=0), traced without duck sizing. One config per pointwise kernel: their kernels
    are small (a step's rows and pages), and compiling every config was 27 of a fresh start's 157 Triton compiles
    (session 48's call 2, on an H200).

    `pdl=False` for a helper of steps with prompt tokens only: a kernel with PDL's launch attribute takes no static
    launcher, so Triton builds it a C launcher with gcc in the main thread (10-13 s of a fresh start, session 49-50),
    for a gap of ~1 µs a kernel that steps of milliseconds do not feel."""
    @functools.cache
    def compiled():
        return without_duck_sizing(compile_region(fn, env_combo_kernels(), autotune_pointwise=False, pdl=pdl))
    return compiled


def without_duck_sizing(compiled_fn):
    """compiled_fn traced with sizes that are equal at the first trace kept as separate symbols. The decode graphs'
    helpers take the bucket's rows beside buffers of every row; the largest bucket, compiled first, fills them, and
    dynamo's duck sizing made the two one symbol, so every smaller bucket compiled take_inputs, the page lists and the
    positions again: 3 of the 4 graphs at 192 rows (TORCH_LOGS=recompiles on the H100, session 29). Only these
    helpers: the model's regions keep their sizes unified. (Set and restored by hand: `fx_config.patch` cost tens of
    µs a call on the CPU, and an eager step calls the page lists once per mask.)"""
    import torch.fx.experimental._config as fx_config

    @functools.wraps(compiled_fn)
    def run(*args, **kwargs):
        before, fx_config.use_duck_shape = fx_config.use_duck_shape, False
        try:
            return compiled_fn(*args, **kwargs)
        finally:
            fx_config.use_duck_shape = before
    return run
