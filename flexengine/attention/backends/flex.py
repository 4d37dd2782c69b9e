"""FlexAttention over the paged pool: the user's logical mods rewritten to physical coordinates (paged_mods.py).

`prepare` runs once per step and builds, for each distinct mask mod of the model, one BlockMask for
the decode rows and one for the prefill tiles (see metadata.py for the layout); every layer with that
mask reuses them. Without compilation (the CPU) the same rewritten mods are evaluated once per step
into dense masks over the step's own pages, and each layer runs SDPA (`forward_dense`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

try:  # torch >= 2.9 asks for the log-sum-exp through return_aux; return_lse is deprecated there
    from torch.nn.attention.flex_attention import AuxRequest
    LSE_KWARGS = {"return_aux": AuxRequest(lse=True)}
except ImportError:
    LSE_KWARGS = {"return_lse": True}

from ...masks import vmap_over_coords
from ..metadata import AttentionMetadata, build_phys_to_logical
from ..layout import KV_TILE, Q_TILE
from ..split_kv import merge_splits_into
from ..workspace import gather_pages
from . import flex_kernels
from .flex_kernels import (call_tiles, compiled_flex, compiled_symbolic, decode_kernel_options, flex_for_decode,
                           flex_for_prefill, flex_memory_stand_in, heads_as_rows_kernel_options, takes_heads_as_rows,
                           whole_blocks)
from .paged_mods import build_block_masks, heads_as_rows_block_mask, paged_mask, paged_score
from .prefill_kernel import PrefillKernel


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
        self.prefill_marked = False  # (PREFILL_SYMBOLIC_FIRST: the symbolic prefill call's first call marked)
        self.stand_in = False  # flex calls only allocate their outputs (memory_stand_in)

    def reserve_workspace(self, pages: int, block_size: int, num_kv_heads: int, head_dim: int, dtype, device) -> None:
        """Allocate the engine's prefill workspace (K and V, shared by every layer: they run one after
        another) of at least `pages` pages, whole KV tiles."""
        step = KV_TILE // math.gcd(block_size, KV_TILE)  # pages per whole number of KV tiles
        self.workspace_pages = -(-pages // step) * step
        device = torch.device(device)
        if self.compiled(device):  # (FA4 or Triton: prepare's padding of a step's call follows it)
            self.prefill_kernel.decide(device, dtype, head_dim)
        if self.direct(block_size, device):  # (its size still bounds what a tile lists)
            self.q_tiles = self.prefill_kernel.q_tiles(device, dtype, head_dim)
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
        return compiled_flex()

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
        if compiled and "call_tiles" not in meta.backend_state:
            self.plan_prefill_call(meta)
        for mask_mod, score_mod in mods:
            if mask_mod not in masks:  # eager: dense masks instead, made when a layer first asks (dense_mask)
                pages = self.workspace_pages if self.workspace_pages is not None else len(meta.ws_src)
                out = meta.backend_state.get("kept_lists", {}).get(mask_mod)  # (a plan graph's: mixed_graphs.py)
                masks[mask_mod] = build_block_masks(view, mask_mod, listed_only, pages, direct,
                                                     meta.layout.q_tiles, out) if compiled else (None, None)
            if score_mod not in scores:
                scores[score_mod] = (paged_score(view, score_mod, True),
                                     paged_score(view, score_mod, False, workspace=compiled and not direct, direct=direct))

    def symbolic_calls(self, device: torch.device) -> bool:
        """Whether flex calls may compile with symbolic rows here (symbolic_flex): an engine's (reserve_workspace)
        compiled calls on CUDA, or on the CPU under the test hook."""
        return ((device.type == "cuda" or flex_kernels.SYMBOLIC_ON_CPU) and self.workspace_pages is not None
                and self.compiled(device))

    def plan_prefill_call(self, meta: AttentionMetadata) -> None:
        """Decide once a step, for the rows, the lists and the call alike (backend_state), whether the prefill call
        runs symbolic (flex_kernels.PREFILL_DYNAMIC; not on FA4, which compiles one kernel for every bucket by itself)
        and its q tiles: the layout's, or two for one where the symbolic call is compiled from its first call
        (PREFILL_SYMBOLIC_FIRST: dynamo specialises a size of 1, and a one-tile call would compile a graph of its
        own; the second tile lists no page, so the kernel computes nothing there)."""
        lay, state = meta.layout, meta.backend_state
        state["symbolic_prefill"] = symbolic = (flex_kernels.PREFILL_DYNAMIC and not self.prefill_kernel.serves_flash()
                                                and self.symbolic_calls(meta.block_tables.device))
        one_tile = lay.num_tiles == 1 and lay.q_tiles == 1
        state["call_tiles"] = 2 if symbolic and flex_kernels.PREFILL_SYMBOLIC_FIRST and one_tile else lay.num_tiles

    def decode_heads_as_rows(self, flex, query, k, v, meta: AttentionMetadata, mask_mod, score_mod, scale):
        """Decode rows' attention on flex's attention template (takes_heads_as_rows): query [rows, Hq, D] as
        [rows, Hkv, G, D], each KV head's G query heads its query rows, no GQA in the kernel → [rows, Hq, D]."""
        rows, Hq, D = query.shape
        Hkv, P = k.shape[1], meta.block_size
        G = Hq // Hkv
        block_mask, score = self.heads_as_rows_mods(meta, mask_mod, score_mod, G)
        fn, k, v = self.symbolic_flex(flex_kernels.DECODE_DYNAMIC, flex_for_decode, flex, query, k, v)
        out = fn(query.reshape(rows, Hkv, G, D), k, v, score_mod=score, block_mask=block_mask, scale=scale,
                 enable_gqa=False, kernel_options=heads_as_rows_kernel_options(P, query))
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

    def symbolic_flex(self, on: bool, fn, flex, query: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """The compile of `fn` (flex_kernels.flex_for_prefill or flex_for_decode) whose rows are symbolic, for an
        engine's (reserve_workspace) compiled calls on CUDA when `on` (flex_kernels.PREFILL_DYNAMIC, DECODE_DYNAMIC);
        otherwise `flex`. An engine's pool, heads and head size never change, so only what scales with the step's
        tiles or rows goes symbolic; K and V are marked static all the same (~4 µs each on the dev CPU), so that
        another engine's pool in the same process cannot make this one's KV length symbolic. The marks go on aliases
        of K and V, returned with the call: the step's static flex calls take the same K and V, and a mark on a tensor
        that a static graph was compiled without fails its guard (a mixed step's decode rows compiled again after
        warm-up at 128-token pages). The functional API's calls, over pools of any size, compile per shape;
        Inductor's CPU template (tests only) fails to build a symbolic tile count on torch 2.13 (a C++ error)."""
        if not (on and self.symbolic_calls(query.device) and flex is compiled_flex()):
            return flex, k, v
        k, v = k.detach(), v.detach()
        torch._dynamo.mark_static(k)
        torch._dynamo.mark_static(v)
        return compiled_symbolic(fn), k, v

    def prefill(self, flex, q, k, v, score_mod, block_mask, scale, gqa, meta: AttentionMetadata):
        """The prefill tiles' flex call, on FA4 or the Triton template (prefill_kernel.py)."""
        def call():
            options = self.prefill_kernel.options(q)
            # (prepare's plan; after FA4 refused a mod, the Triton call of that step compiles for its bucket)
            on = meta.backend_state["symbolic_prefill"] and "BACKEND" not in options
            fn, kc, vc = self.symbolic_flex(on, flex_for_prefill, flex, q, k, v)
            traced = contextlib.nullcontext()
            if fn is not flex:
                options = {**options, "IS_DIVISIBLE": whole_blocks(q, k, block_mask)}
                if flex_kernels.PREFILL_SYMBOLIC_FIRST and not self.prefill_marked:  # (its first call only)
                    state = meta.backend_state
                    limits = [state["prefill_limits"]] if "prefill_limits" in state else []
                    traced = flex_kernels.symbolic_from_the_start(q, block_mask, [*state.get("prefill_rows", ()),
                                                                                  *limits])
                    self.prefill_marked = True
            with traced:
                return fn(q, kc, vc, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=gqa,
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
            R = call_tiles(meta) * Q_TILE
            assert R >= T, (R, T)
            kw, vw = (k, v) if self.direct(P, query.device) else self.gather_workspace(key_cache, value_cache, meta)
            qp = query if R == T else F.pad(query, (0, 0, 0, 0, 0, R - T))  # the engine pads; the functional API not
            op = self.prefill(flex, qp.transpose(0, 1).unsqueeze(0), kw, vw, pre_sm, pre_bm, scale, gqa, meta)
            out = op[0].transpose(0, 1)[:T]  # decode tokens' rows are overwritten below
        else:
            out = query.new_empty(T, Hq, D)
        if lay.num_decode:  # padding decode rows have no token row (dst -1): dropped
            rows_q = query[meta.decode_src]  # [Bd * S, Hq, D]
            qd = rows_q.unsqueeze(2)
            S = lay.decode_splits
            if S == 1:  # (heads as rows: the decode-only steps' kernel, so a mixed step's rows compile nothing more)
                if heads_as_rows:
                    od = self.decode_heads_as_rows(flex, rows_q, k, v, meta, mask_mod, score_mod, scale)
                else:
                    od = flex(qd, k, v, score_mod=dec_sm, block_mask=dec_bm, scale=scale, enable_gqa=gqa,
                              **opts)[:, :, 0]
                merge_splits_into(out, meta.decode_dst, od, None, 1)
            else:  # the splits' merge and the scatter to the token rows: one launch on CUDA
                od, lse = flex(qd, k, v, score_mod=dec_sm, block_mask=dec_bm, scale=scale, enable_gqa=gqa,
                               **opts, **LSE_KWARGS)
                lse = getattr(lse, "lse", lse)
                merge_splits_into(out, meta.decode_dst, od[:, :, 0], lse[:, :, 0], S)
        return out
