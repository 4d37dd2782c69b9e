"""Which compiled flex call serves each of the paged backend's calls (flex.py), and the kernel options it takes: the
decode rows' (flex's decode template, or its attention template with query heads as rows) and the prefill tiles' (one
compile per bucket, or one for a symbolic tile count). Module flags here are what scripts and tests set.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch.nn.attention.flex_attention import flex_attention

from ...compile import configure_dynamo, pdl_options, without_duck_sizing


@functools.cache
def compiled_flex():
    # Eager flex materialises the whole score matrix; on a GPU only the compiled kernel is acceptable,
    # so fullgraph (no graph breaks) and a recompile budget that raises when exhausted. Shapes are
    # static: the engine pads decode rows and prefill tiles to buckets, one compile per bucket
    # (symbolic-shape flex kernels hit an illegal memory access on torch 2.11 in the engine's mixed
    # steps; see docs/benchmarks.md); an engine's prefill calls take their own compile, PREFILL_DYNAMIC.
    configure_dynamo()
    # FLEXENGINE_PDL's option, for the kernels around the template (Inductor gives templates no PDL)
    return torch.compile(flex_attention, dynamic=False, fullgraph=True, options=pdl_options())


def flex_for_prefill(query, key, value, score_mod, block_mask, scale, enable_gqa, kernel_options):
    """flex_attention for the prefill tiles, compiled with a symbolic tile count (FlexBackend.symbolic_flex): a
    function of its own (a code object of its own: a closure would share one), so that its graphs and dynamo's record
    of the sizes it saw keep apart from the decode rows'."""
    return flex_attention(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale,
                          enable_gqa=enable_gqa, kernel_options=kernel_options)


# Whether an engine's Triton prefill call compiles with dynamo's automatic dynamic shapes (FlexBackend.symbolic_flex):
# the first bucket static (one tile: dynamo specialises size 1), the next a graph whose tile count is symbolic, which
# then serves every bucket after it; the pool (the KV length) stays a constant. Otherwise a Triton kernel per bucket,
# 11 at an 8,192-token budget, each ~2.5 s of a fresh start compiled one after another (session 45, an H200 box: 19
# flex kernels, 48 s of a 145 s start; 102 s with symbolic tiles). With IS_DIVISIBLE passed (whole_blocks) the
# symbolic kernel takes 0.88-1.00x the per-bucket kernels' time (session 46, scripts/prefill_dynamic_probe.py).
PREFILL_DYNAMIC = True


# Whether the symbolic prefill call is compiled symbolic from its first call (its tile-count dimensions marked
# dynamic, symbolic_from_the_start), with a one-tile step's call padded to two tiles (call_tiles: an empty second tile,
# which lists no page), so that the prefill call is one graph where automatic dynamic shapes made two (the first
# bucket's static graph, then the symbolic one: ~4 s of Triton's template each at a fresh start, session 52's logs).
# Session 53, one H200 box: `flex_for_prefill` 1 graph of 3.8-4.7 s against 2 of 9.1-9.6 s a fresh start, and the
# one-tile step's padding within the box's spread (batch 1's prefill + 1 token 3.45 / 3.09 ms against 3.36 / 3.50).
PREFILL_SYMBOLIC_FIRST = True


def call_tiles(meta) -> int:
    """The prefill call's q tiles this step, as FlexBackend.prepare decided them once for the rows, the lists and the
    call alike (backend_state "call_tiles"); the layout's for metadata no compiled prepare planned (a mask built
    directly, as test_tile_page_lists does)."""
    return meta.backend_state.get("call_tiles", meta.layout.num_tiles)


@contextlib.contextmanager
def symbolic_from_the_start(query, block_mask, captured: list):
    """The symbolic prefill call's first compile (PREFILL_SYMBOLIC_FIRST) with what scales with its tiles dynamic, as
    dynamo's automatic dynamic shapes made them in the second graph: the query's rows, the BlockMask's q blocks and
    its q length (an int: through torch.compiler.config.dynamic_sources), the mods' per-row tables `captured`.
    maybe_mark_dynamic: a size that traces static anyway costs a graph per bucket, not an error."""
    torch._dynamo.maybe_mark_dynamic(query, 2)
    for t in (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
              block_mask.full_kv_indices):
        if t is not None:
            torch._dynamo.maybe_mark_dynamic(t, 2)
    for t in captured:
        torch._dynamo.maybe_mark_dynamic(t, 0)
    with torch.compiler.config.patch(dynamic_sources=r"L\['block_mask'\]\.seq_lengths\[0\]"):
        yield


def whole_blocks(query, key, block_mask) -> bool:
    """Inductor's test for flex's IS_DIVISIBLE (no bounds checks on any load or score: both lengths multiples of 128
    and of the mask's blocks), made here on the concrete lengths: for a symbolic q length Inductor cannot prove it
    and the kernel bounds-checks every load and score, 10-23% slower on the H200 (session 45)."""
    def whole(length, block):
        return length % 128 == 0 and (length % block == 0 or block >= length)
    q_block, kv_block = block_mask.BLOCK_SIZE
    return whole(query.shape[-2], q_block) and whole(key.shape[-2], kv_block)


def flex_for_decode(query, key, value, score_mod, block_mask, scale, enable_gqa, kernel_options):
    """flex_attention for decode rows with query heads as rows, compiled with a symbolic row count
    (FlexBackend.symbolic_flex): a function of its own, as flex_for_prefill is."""
    return flex_attention(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale,
                          enable_gqa=enable_gqa, kernel_options=kernel_options)


# Whether an engine's unsplit decode rows (decode-only and mixed steps) all run with query heads as rows
# (takes_heads_as_rows), compiled with dynamo's automatic dynamic shapes as PREFILL_DYNAMIC does for the prefill tiles:
# at max_num_seqs 256 the decode template's buckets 256, 192, 128, 96 and 64 are 5 compiles of ~2.2 s each on a fresh
# H200 box (session 46's recompile log). Not on flex's decode template: its lowering takes a static batch only
# (_use_flex_decoding in torch/_inductor/kernel/flex/flex_decoding.py) and a symbolic one falls back to the attention
# template with 128-row q tiles for one query row, 5.7-6.4x slower at 64-256 rows (session 47,
# scripts/prefill_dynamic_probe.py); the attention template with heads as rows takes a symbolic batch as it is.
DECODE_DYNAMIC = False
SYMBOLIC_ON_CPU = False  # (a test hook: with dynamo's eager backend, conftest's gpu_shaped_engines, the CPU takes both)


@functools.cache
def compiled_symbolic(fn):
    """`fn` (flex_for_prefill or flex_for_decode) compiled with dynamo's automatic dynamic shapes."""
    configure_dynamo()  # FLEXENGINE_PDL for the decode rows' call only, as compile_region's `pdl` says why
    options = pdl_options() if fn is flex_for_decode else {}
    return without_duck_sizing(torch.compile(fn, dynamic=None, fullgraph=True, options=options))


def clear_compiled() -> None:
    """Forget the compiled flex calls (for tests that swap torch.compile's backend)."""
    compiled_flex.cache_clear()
    compiled_symbolic.cache_clear()


def flex_memory_stand_in(query, key, value, *args, **kwargs) -> torch.Tensor:
    """flex_attention's output, uninitialised, after the log-sum-exp its kernels allocate beside it (for memory
    profiling only). In the query's stride order, as Inductor lays flex's output out (infer_dense_strides): the
    layers after it compile for the strides they will see (a contiguous stand-in cost one more graph of the
    region after attention, session 31)."""
    B, H, L, _ = query.shape
    lse = torch.empty(B, H, L, dtype=torch.float32, device=query.device)
    outer_first = sorted(range(4), key=lambda d: -query.stride(d))  # (stable: ties keep their order)
    shape = (B, H, L, value.shape[-1])
    out = query.new_empty([shape[d] for d in outer_first]).permute([outer_first.index(d) for d in range(4)])
    del lse  # (held while out was made, as the kernel's call holds both)
    return out


# Tile options for flex's decode template, on top of its own; None: `default_decode_options`
# (scripts/decode_step_probe.py sets others).
DECODE_OPTIONS: dict | None = None


@functools.cache
def default_decode_options(device: torch.device, head_dim: int, dtype: torch.dtype) -> dict:
    """Three pipeline stages on sm90 and sm100, as torch 2.11's heuristic picks them there (except for float32 heads
    over 128, whose stages would not fit shared memory) before it overwrites them with its generic default
    (torch/_inductor/template_heuristics/triton.py, get_flex_decode_configs), so that each program waited on every KV
    tile's load. H100, session 25, same call: batch-32 decode 1.602 -> 1.529 ms a step; the attention table's decode
    rows at 128-token pages 0.90x -> 0.98x SDPA-flash at 8x8192, 1.12x -> 1.06x at 64x2048, and 2x faster at 16-token
    pages (8x8192: 241 -> 126 µs)."""
    if device.type != "cuda" or (head_dim > 128 and dtype == torch.float32):
        return {}
    return {"num_stages": 3} if torch.cuda.get_device_capability(device) in ((9, 0), (10, 0), (10, 3)) else {}


def decode_kernel_options(P: int, splits: int, query: torch.Tensor) -> dict:
    """flex's decode kernel_options for pages of P tokens and `splits` programs per row (its SPLIT_KV) for `query`'s
    device, head size and dtype: the KV tile must divide the page."""
    default = DECODE_OPTIONS is None
    tiles = default_decode_options(query.device, query.shape[-1], query.dtype) if default else DECODE_OPTIONS
    options = {"SPLIT_KV": splits, **tiles}
    if P < options.get("BLOCK_N", 128):
        options["BLOCK_N"] = P
    return options


# The decode rows of steps with at most this many (unsplit) run flex's attention template instead of its decode
# template, with each KV head's group of query heads as its query rows (q [rows, Hkv, G, D]): the decode template
# leaves a float32 accumulator that a kernel of its own then normalises (21 µs a step at batch 32 on the H100, 16
# launches: session 36's profile), where the attention template writes the output itself. A mixed step's decode rows
# take it too, so that they compile no other kernel than the decode-only steps' of their bucket. 0: never
# (scripts/decode_step_probe.py heads_as_rows=N). 32: batch 32 −8 to −37 µs a step on two H100 boxes, batch 1 and 8
# unchanged, no graph more (session 41 in docs/benchmarks.md).
DECODE_HEADS_AS_ROWS = 32
HEADS_AS_ROWS_ON_CPU = False  # (a test hook: the CPU's compiled flex then takes it too)


# Head sizes up to this take it: those timed and tested on the H100 (16-128); larger ones (Gemma-2's 256) keep the
# decode template, whose tiles for them are proven, where a forced 16 x 64 tile's stages are not
HEADS_AS_ROWS_MAX_HEAD_DIM = 128


def takes_heads_as_rows(lay, query: torch.Tensor) -> bool:
    """Whether a step's decode rows run on flex's attention template with query heads as rows (DECODE_HEADS_AS_ROWS;
    every unsplit row with DECODE_DYNAMIC)."""
    return ((query.is_cuda or HEADS_AS_ROWS_ON_CPU) and lay.kernel_splits == 1
            and query.shape[-1] <= HEADS_AS_ROWS_MAX_HEAD_DIM
            and (lay.num_decode <= DECODE_HEADS_AS_ROWS or DECODE_DYNAMIC))


HEADS_AS_ROWS_TILES = {"BLOCK_N": 64}  # (scripts/decode_step_probe.py heads_block_n=..., heads_num_warps=..., ...)


def heads_as_rows_kernel_options(P: int, query: torch.Tensor) -> dict:
    """flex's attention template for rows of a few query heads: the smallest tile of rows (16, for tl.dot) and a KV
    tile that divides the page; the CPU's template takes no options."""
    if not query.is_cuda:
        return {}
    options = {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": 16, **HEADS_AS_ROWS_TILES}
    options["BLOCK_N"] = min(P, options["BLOCK_N"])
    return options
