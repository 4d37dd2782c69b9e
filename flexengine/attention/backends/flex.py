"""FlexAttention over the paged pool: the user's logical mods rewritten to physical coordinates (paged_mods.py).

`prepare` runs once per step and builds, for each distinct mask mod of the model, one BlockMask for
the decode rows and one for the prefill tiles (see metadata.py for the layout); every layer with that
mask reuses them. Without compilation (the CPU) the same rewritten mods are evaluated once per step
into dense masks over the step's own pages, and each layer runs SDPA (`forward_dense`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

try:  # torch >= 2.9 asks for the log-sum-exp through return_aux; return_lse is deprecated there
    from torch.nn.attention.flex_attention import AuxRequest
    LSE_KWARGS = {"return_aux": AuxRequest(lse=True)}
except ImportError:
    LSE_KWARGS = {"return_lse": True}

from ...compile import configure_dynamo, pdl_options, without_duck_sizing
from ...masks import vmap_over_coords
from ..metadata import AttentionMetadata, build_phys_to_logical
from ..layout import KV_TILE, Q_TILE
from ..split_kv import merge_splits_into
from ..workspace import gather_pages
from .paged_mods import build_block_masks, heads_as_rows_block_mask, paged_mask, paged_score
from .prefill_kernel import PrefillKernel


@functools.cache
def _compiled_flex():
    # Eager flex materialises the whole score matrix; on a GPU only the compiled kernel is acceptable,
    # so fullgraph (no graph breaks) and a recompile budget that raises when exhausted. Shapes are
    # static: the engine pads decode rows and prefill tiles to buckets, one compile per bucket
    # (symbolic-shape flex kernels hit an illegal memory access on torch 2.11 in the engine's mixed
    # steps; see docs/benchmarks.md); an engine's prefill calls take their own compile, PREFILL_DYNAMIC.
    configure_dynamo()
    # FLEXENGINE_PDL's option, for the kernels around the template (Inductor gives templates no PDL)
    return torch.compile(flex_attention, dynamic=False, fullgraph=True, options=pdl_options())


def _flex_prefill(query, key, value, score_mod, block_mask, scale, enable_gqa, kernel_options):
    """flex_attention for the prefill tiles, compiled with a symbolic tile count (FlexBackend.symbolic_tiles): a
    function of its own, so that its graphs and dynamo's record of the sizes it saw keep apart from the decode rows'."""
    return flex_attention(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale,
                          enable_gqa=enable_gqa, kernel_options=kernel_options)


# Whether an engine's Triton prefill call compiles with dynamo's automatic dynamic shapes (FlexBackend.symbolic_tiles):
# the first bucket static (one tile: dynamo specialises size 1), the next a graph whose tile count is symbolic, which
# then serves every bucket after it; the pool (the KV length) stays a constant. Otherwise a Triton kernel per bucket,
# 11 at an 8,192-token budget, each ~2.5 s of a fresh start compiled one after another (session 45, an H200 box: 19
# flex kernels, 48 s of a 145 s start; 102 s with symbolic tiles). With IS_DIVISIBLE passed (whole_blocks) the
# symbolic kernel takes 0.88-1.00x the per-bucket kernels' time (session 46, scripts/prefill_dynamic_probe.py).
PREFILL_DYNAMIC = True


def whole_blocks(query, key, block_mask) -> bool:
    """Inductor's test for flex's IS_DIVISIBLE (no bounds checks on any load or score: both lengths multiples of 128
    and of the mask's blocks), made here on the concrete lengths: for a symbolic q length Inductor cannot prove it
    and the kernel bounds-checks every load and score, 10-23% slower on the H200 (session 45)."""
    def whole(length, block):
        return length % 128 == 0 and (length % block == 0 or block >= length)
    q_block, kv_block = block_mask.BLOCK_SIZE
    return whole(query.shape[-2], q_block) and whole(key.shape[-2], kv_block)


@functools.cache
def _compiled_prefill_flex():
    configure_dynamo()
    return without_duck_sizing(torch.compile(_flex_prefill, dynamic=None, fullgraph=True, options=pdl_options()))


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
    """Whether a step's decode rows run on flex's attention template with query heads as rows (DECODE_HEADS_AS_ROWS)."""
    return (DECODE_HEADS_AS_ROWS > 0 and (query.is_cuda or HEADS_AS_ROWS_ON_CPU) and lay.kernel_splits == 1
            and query.shape[-1] <= HEADS_AS_ROWS_MAX_HEAD_DIM and lay.num_decode <= DECODE_HEADS_AS_ROWS)


HEADS_AS_ROWS_TILES = {"BLOCK_N": 64}  # (scripts/decode_step_probe.py heads_block_n=..., heads_num_warps=..., ...)


def heads_as_rows_kernel_options(P: int, query: torch.Tensor) -> dict:
    """flex's attention template for rows of a few query heads: the smallest tile of rows (16, for tl.dot) and a KV
    tile that divides the page; the CPU's template takes no options."""
    if not query.is_cuda:
        return {}
    options = {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": 16, **HEADS_AS_ROWS_TILES}
    options["BLOCK_N"] = min(P, options["BLOCK_N"])
    return options


# Compiled prefill over pages of KV_TILE tokens reads them in place (tile_page_lists) rather than from a copy in the
# workspace (the copy was 50 of 379 µs at 32 x 512 on the H100, session 12); False: the workspace, as smaller pages need.
DIRECT_PAGES = True


class FlexBackend:
    name = "flex"

    def __init__(self, compile: bool | None = None):
        self.compile = compile  # None: compile on CUDA, eager on CPU (where Inductor's flex is slow to build)
        # Pages of the prefill workspace: fixed by the engine (reserve_workspace), so that the compiled
        # prefill kernel's KV length never changes; None sizes it to each call (functional API).
        self.workspace_pages: int | None = None
        self._workspace: tuple[torch.Tensor, torch.Tensor] | None = None
        self.prefill_kernel = PrefillKernel()  # FA4 or Triton for the compiled prefill call
        self.q_tiles = 1  # prefill tiles per q block of long steps' in-place prefill call (reserve_workspace chooses)
        self.stand_in = False  # flex calls only allocate their outputs (memory_stand_in)

    def reserve_workspace(self, pages: int, block_size: int, num_kv_heads: int, head_dim: int, dtype, device) -> None:
        """Allocate the engine's prefill workspace (K and V, shared by every layer: they run one after
        another) of at least `pages` pages, whole KV tiles."""
        step = KV_TILE // math.gcd(block_size, KV_TILE)  # pages per whole number of KV tiles
        self.workspace_pages = -(-pages // step) * step
        if self.direct(block_size, torch.device(device)):  # (its size still bounds what a tile lists)
            self.q_tiles = self.prefill_kernel.q_tiles(torch.device(device), dtype, head_dim)
            return
        shape = (self.workspace_pages, block_size, num_kv_heads, head_dim)
        self._workspace = (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    def direct(self, block_size: int, device: torch.device) -> bool:
        """Whether the compiled prefill call reads the pool's pages in place (pages of KV_TILE tokens)."""
        return DIRECT_PAGES and block_size == KV_TILE and self.compiled(device)

    def gather_workspace(self, key_cache, value_cache, meta: AttentionMetadata):
        """Copy the prefilling requests' pages into the workspace: k, v as [1, Hkv, pages * P, D]."""
        W = len(meta.ws_src)
        if self._workspace is None or self.workspace_pages is None:
            # zeros: a KV tile also reads the uncopied pages of its request's alignment tail, whose V is
            # multiplied by a zero probability (garbage NaN there would survive it)
            ks, vs = key_cache.new_zeros(W, *key_cache.shape[1:]), value_cache.new_zeros(W, *value_cache.shape[1:])
        else:
            ks, vs = self._workspace
            assert W <= len(ks) and ks.shape[1:] == key_cache.shape[1:] and ks.dtype == key_cache.dtype, \
                (W, ks.shape, key_cache.shape, ks.dtype, key_cache.dtype)
        gather_pages(key_cache, value_cache, meta.ws_src, ks, vs)
        NB, P, Hkv, D = ks.shape
        return ks.view(1, NB * P, Hkv, D).transpose(1, 2), vs.view(1, NB * P, Hkv, D).transpose(1, 2)

    def compiled(self, device: torch.device) -> bool:
        return self.compile if self.compile is not None else device.type == "cuda"

    def flex_fn(self):
        """The compiled kernel (the eager path, forward_dense, runs no flex call at all)."""
        if self.stand_in:
            return flex_memory_stand_in
        if torch.compiler.is_compiling():  # inside a compiled model: dynamo traces the flex op itself
            return flex_attention
        return _compiled_flex()

    @contextlib.contextmanager
    def memory_stand_in(self):
        """Inside, compiled flex calls allocate what the kernel's call does and compute nothing: for the KV
        sizing's profiling step. That step runs on a scratch cache, flex compiles once per shape, and the real
        cache's shape differs, so its compile was thrown away: FA4's CuTe JIT alone took 16 s of a 150 s fresh
        start on the H100 (session 31), for a kernel no step ever ran again."""
        self.stand_in = True
        try:
            yield
        finally:
            self.stand_in = False

    def compact(self, meta: AttentionMetadata) -> AttentionMetadata:
        """The eager path scores every slot of the pool it is given, so hand it only the step's pages.

        The compact pool holds the used pages in block-table order and the tables are renumbered; the
        compiled kernel skips unlisted pages by itself and keeps the whole pool (no copy).
        """
        P = meta.block_size
        tables = meta.block_tables.cpu()
        used = [tables[i, : (L + P - 1) // P] for i, L in enumerate(meta.seq_lens.tolist())]
        pages = torch.unique(torch.cat(used)) if used else torch.zeros(1, dtype=torch.int32)
        renumber = torch.zeros(meta.num_blocks, dtype=torch.int32)
        renumber[pages.long()] = torch.arange(len(pages), dtype=torch.int32)
        device = meta.block_tables.device
        compact_tables = renumber[tables.long().clamp(0, meta.num_blocks - 1)].to(device)
        n = max(1, len(pages))
        return dataclasses.replace(
            meta, block_tables=compact_tables, num_blocks=n, backend_state={"pages": pages.long().to(device)},
            phys_to_logical=build_phys_to_logical(compact_tables, meta.seq_lens, P, n))

    def prepare(self, meta: AttentionMetadata, mods) -> None:
        """Build each distinct mask's BlockMasks (compiled) and each distinct score mod's rewrite, once per
        step; the eager path gets the step's compacted pages instead (see forward_dense)."""
        device = meta.block_tables.device
        compiled = self.compiled(device)
        # The Triton kernel reads exactly the listed pages (its KV tile divides the page); Inductor's CPU
        # template reads blocks of its own width, which can run past a page into another request's.
        listed_only = compiled and device.type == "cuda"
        direct = self.direct(meta.block_size, device)
        if not compiled and "view" not in meta.backend_state:
            meta.backend_state["view"] = self.compact(meta)
        view = meta.backend_state.get("view", meta)  # the metadata the kernels see
        masks, scores = meta.backend_state.setdefault("masks", {}), meta.backend_state.setdefault("scores", {})
        for mask_mod, score_mod in mods:
            if mask_mod not in masks:  # eager: dense masks instead, made when a layer first asks (dense_mask)
                pages = self.workspace_pages if self.workspace_pages is not None else len(meta.ws_src)
                out = meta.backend_state.get("kept_lists", {}).get(mask_mod)  # (a plan graph's: mixed_graphs.py)
                masks[mask_mod] = build_block_masks(view, mask_mod, listed_only, pages, direct,
                                                     meta.layout.q_tiles, out) if compiled else (None, None)
            if score_mod not in scores:
                scores[score_mod] = (paged_score(view, score_mod, True),
                                     paged_score(view, score_mod, False, workspace=compiled and not direct, direct=direct))

    def decode_heads_as_rows(self, flex, query, k, v, meta: AttentionMetadata, mask_mod, score_mod, scale):
        """Decode rows' attention on flex's attention template (takes_heads_as_rows): query [rows, Hq, D] as
        [rows, Hkv, G, D], each KV head's G query heads its query rows, no GQA in the kernel → [rows, Hq, D]."""
        rows, Hq, D = query.shape
        Hkv, P = k.shape[1], meta.block_size
        G = Hq // Hkv
        block_mask, score = self.heads_as_rows_mods(meta, mask_mod, score_mod, G)
        out = flex(query.reshape(rows, Hkv, G, D), k, v, score_mod=score, block_mask=block_mask, scale=scale,
                   kernel_options=heads_as_rows_kernel_options(P, query))
        return out.reshape(rows, Hq, D)

    def heads_as_rows_mods(self, meta: AttentionMetadata, mask_mod, score_mod, group: int):
        """The decode BlockMask and score mod for query heads as rows (takes_heads_as_rows), made once per step from
        prepare's decode BlockMask: the same page lists."""
        made = meta.backend_state.setdefault("heads_as_rows", {})
        key = (mask_mod, score_mod, group)
        if key not in made:
            listed_only = meta.block_tables.is_cuda  # (the compiled kernel visits the listed pages alone there)
            made[key] = (heads_as_rows_block_mask(meta, meta.backend_state["masks"][mask_mod][0], mask_mod, group,
                                              listed_only),
                         paged_score(meta, score_mod, True, group=group))
        return made[key]

    def dense_mask(self, meta: AttentionMetadata, mask_mod, num_heads: int, decode: bool, q_len: int = 1):
        """The step's mask over its compacted pages, [rows, Hq, q, kv] bool, evaluated once per step and
        shared by every layer (eager flex evaluated the paged mask through vmap again in each layer)."""
        dense = meta.backend_state.setdefault("dense", {})
        key = (mask_mod, num_heads, decode)
        if key not in dense:
            view, lay = meta.backend_state["view"], meta.layout
            rows = lay.num_decode * lay.decode_splits if decode else 1
            coords = (torch.arange(n, device=view.block_tables.device)
                      for n in (rows, num_heads, q_len, view.num_blocks * view.block_size))
            # plain vmap: flex's create_mask wraps every index op and took 35 ms a step for one decode row
            mask = vmap_over_coords(paged_mask(view, mask_mod, decode), 4)(*coords)
            dense[key] = mask, mask.any(-1, keepdim=True)  # a row that sees no key gives zeros, as flex does
        return dense[key]

    def forward_dense(self, query, k, v, meta: AttentionMetadata, mask_mod, score_mod, scale):
        """Eager attention over the compacted pool (CPU): the step's dense masks, then SDPA per layer, or
        plain math where a score mod must see the scores. k, v: [1, Hkv, N, D]."""
        T, Hq, D = query.shape
        lay = meta.layout
        dec_sm, pre_sm = meta.backend_state["scores"][score_mod]

        def attend(q, mask_and_any, score, rows):  # rows: the flex batch row of each of q's rows
            mask, any_key = mask_and_any
            kk, vv = k.expand(q.shape[0], -1, -1, -1), v.expand(q.shape[0], -1, -1, -1)
            if score is None:
                o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=scale, enable_gqa=Hq != k.shape[1])
            else:
                rep = Hq // k.shape[1]
                kk, vv = kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1)
                coords = (torch.arange(n, device=q.device) for n in (Hq, q.shape[2], kk.shape[2]))
                s = (q.float() @ kk.float().transpose(-1, -2)) * scale
                s = vmap_over_coords(score, 5, first=1)(s, rows, *coords)
                o = (s.masked_fill(~mask, float("-inf")).softmax(-1) @ vv.float()).to(q.dtype)
            return torch.where(any_key, o, 0)

        if lay.decode_in_place:  # as forward's: the queries and outputs where they are
            rows = torch.arange(T, device=query.device)
            return attend(query.unsqueeze(2), self.dense_mask(meta, mask_mod, Hq, decode=True), dec_sm, rows)[:, :, 0]
        if lay.num_tiles:  # every token row, in place; decode tokens are dead here and overwritten below
            row0 = query.new_zeros(1, dtype=torch.long)  # the prefill call is one flex batch row
            mask = self.dense_mask(meta, mask_mod, Hq, decode=False, q_len=T)
            out = attend(query.transpose(0, 1).unsqueeze(0), mask, pre_sm, row0)[0].transpose(0, 1)
        else:
            out = query.new_empty(T, Hq, D)
        if lay.num_decode:  # split-KV rows (tests only, off CUDA) see every page here: one row per request
            S = lay.decode_splits
            mask, any_key = self.dense_mask(meta, mask_mod, Hq, decode=True)
            rows = torch.arange(0, lay.num_decode * S, S, device=query.device)
            od = attend(query[meta.decode_src[rows]].unsqueeze(2), (mask[rows], any_key[rows]), dec_sm, rows)
            merge_splits_into(out, meta.decode_dst, od.squeeze(2), None, 1)
        return out

    def symbolic_tiles(self, flex, options: dict, query: torch.Tensor) -> bool:
        """Whether a prefill call takes the compile whose tile count is symbolic (PREFILL_DYNAMIC): an engine's
        (reserve_workspace) compiled Triton calls on CUDA. An engine's pool, heads and head size never change, so only
        what scales with the step's tiles goes symbolic; K and V are marked static all the same (~4 µs each on the dev CPU), so
        that another engine's pool in the same process cannot make this one's KV length symbolic. FA4 compiles one
        kernel for every bucket by itself (and its wide q blocks are one bucket's); the functional API's calls, over
        pools of any size, compile per shape; Inductor's CPU template (tests only) fails to build a symbolic tile
        count on torch 2.13 (a C++ error)."""
        return (PREFILL_DYNAMIC and query.is_cuda and self.workspace_pages is not None and flex is _compiled_flex()
                and "BACKEND" not in options)

    def prefill(self, flex, q, k, v, score_mod, block_mask, scale, gqa):
        """The prefill tiles' flex call, on FA4 or the Triton template (prefill_kernel.py)."""
        def call():
            options = self.prefill_kernel.options(q)
            fn = flex
            if self.symbolic_tiles(flex, options, q):
                fn = _compiled_prefill_flex()
                torch._dynamo.mark_static(k)  # (see symbolic_tiles)
                torch._dynamo.mark_static(v)
                options = {**options, "IS_DIVISIBLE": whole_blocks(q, k, block_mask)}
            return fn(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                      kernel_options=options)
        try:
            return call()
        except Exception as e:  # FA4's code generator refusing a mod: auto falls back, and says so once
            if not self.prefill_kernel.refused(e):
                raise
        return call()

    def forward(self, query, key_cache, value_cache, meta: AttentionMetadata, mask_mod, score_mod, scale):
        T, Hq, D = query.shape
        NB, P, Hkv, _ = key_cache.shape
        lay = meta.layout
        if mask_mod not in meta.backend_state.get("masks", {}) or score_mod not in meta.backend_state["scores"]:
            self.prepare(meta, [(mask_mod, score_mod)])
        dec_bm, pre_bm = meta.backend_state["masks"][mask_mod]
        dec_sm, pre_sm = meta.backend_state["scores"][score_mod]
        view = meta.backend_state.get("view")
        if view is not None:
            pages = view.backend_state["pages"]
            key_cache, value_cache, NB = key_cache[pages], value_cache[pages], len(pages)
        k = key_cache.view(1, NB * P, Hkv, D).transpose(1, 2)
        v = value_cache.view(1, NB * P, Hkv, D).transpose(1, 2)
        if view is not None:
            return self.forward_dense(query, k, v, meta, mask_mod, score_mod, scale)
        flex = self.flex_fn()
        gqa = Hq != Hkv
        opts = {"kernel_options": decode_kernel_options(P, lay.kernel_splits, query)}
        heads_as_rows = takes_heads_as_rows(lay, query)
        if lay.decode_in_place and heads_as_rows:
            return self.decode_heads_as_rows(flex, query, k, v, meta, mask_mod, score_mod, scale)
        if lay.decode_in_place:  # [T, Hq, 1, D] in, out: at S = 1 a gather and a scatter launch fewer per layer
            return flex(query.unsqueeze(2), k, v, score_mod=dec_sm, block_mask=dec_bm, scale=scale, enable_gqa=gqa,
                        **opts)[:, :, 0]
        if lay.num_tiles:  # the token buffer itself, as whole tiles: [1, Hq, Tp * Q_TILE, D], no gather
            if len(meta.ws_src) == 0:
                raise ValueError("compiled flex prefill needs the workspace layout: plan_layout(..., block_size=P)")
            R = lay.num_tiles * Q_TILE
            assert R >= T, (R, T)
            kw, vw = (k, v) if self.direct(P, query.device) else self.gather_workspace(key_cache, value_cache, meta)
            qp = query if R == T else F.pad(query, (0, 0, 0, 0, 0, R - T))  # the engine pads; the functional API not
            op = self.prefill(flex, qp.transpose(0, 1).unsqueeze(0), kw, vw, pre_sm, pre_bm, scale, gqa)
            out = op[0].transpose(0, 1)[:T]  # decode tokens' rows are overwritten below
        else:
            out = query.new_empty(T, Hq, D)
        if lay.num_decode:  # padding decode rows have no token row (dst -1): dropped
            rows_q = query[meta.decode_src]  # [Bd * S, Hq, D]
            qd = rows_q.unsqueeze(2)
            S = lay.decode_splits
            if S == 1:  # (heads as rows: the decode-only steps' kernel, so a mixed step's rows compile nothing more)
                od = (self.decode_heads_as_rows(flex, rows_q, k, v, meta, mask_mod, score_mod, scale) if heads_as_rows
                      else flex(qd, k, v, score_mod=dec_sm, block_mask=dec_bm, scale=scale, enable_gqa=gqa,
                                **opts)[:, :, 0])
                merge_splits_into(out, meta.decode_dst, od, None, 1)
            else:  # the splits' merge and the scatter to the token rows: one launch on CUDA
                od, lse = flex(qd, k, v, score_mod=dec_sm, block_mask=dec_bm, scale=scale, enable_gqa=gqa,
                               **opts, **LSE_KWARGS)
                lse = getattr(lse, "lse", lse)
                merge_splits_into(out, meta.decode_dst, od[:, :, 0], lse[:, :, 0], S)
        return out
