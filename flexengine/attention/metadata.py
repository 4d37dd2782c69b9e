"""The once-per-step attention metadata: where each query sits, and which pages each query tile reads.

Layout (chosen by measurement, see docs/benchmarks.md and DESIGN.md's baselines):
- The KV pool of a layer is viewed as ONE sequence `[1, Hkv, num_blocks * block_size, D]`, and the
  flex KV block equals the page, so a block table row IS a list of flex kv block indices. No copy of
  K/V, and physical placement never changes which keys a tile sees.
- Decode rows (query_len == 1) get one flex batch row each: `[Bd, Hq, 1, D]`, the shape the flex
  decoding kernel (split-KV, GQA-packed) wants. Each row's BlockMask lists exactly its own pages.
- The prefill call's queries are the step's token buffer itself, in packed order, viewed as
  `[1, Hq, Tp * 128, D]`: no gather of the queries and none of the output (the two gathers took 30%
  of the prefill time at 8 x 1024 tokens on the H100; docs/benchmarks.md, session 11). The engine pads
  the buffer to whole tiles. A tile may hold the end of one request and the start of the next; rows
  that are not prefill queries (decode tokens, padding) are dead: no key is live for them, and the
  decode call overwrites the decode tokens' rows afterwards.
- Prefill tiles read KV blocks of KV_TILE (128) tokens. Where a page is that size (the GPU's default), a
  block IS a page and the compiled kernel reads the pool in place: a tile lists the pages of each request
  it holds (`tile_page_lists`; a page two of them share, a cached prefix, once), and the mask checks that
  the row's request owns the page (one gather from the block tables, only in partial blocks). With smaller
  pages the pages of each prefilling request are first copied, in logical order, into a contiguous
  workspace (`plan_layout(block_size=...)` lays it out), each request starting on a KV_TILE boundary: the
  kernel then reads 128-token KV blocks whatever the page size (16-token pages capped its tile at 16), and
  the blocks a tile reads are one contiguous range: from its first request's lowest to its last
  request's highest (requests lie in the workspace in token order). Either way a tile of one request also
  gets full blocks, those wholly inside the mask's all-true range.
- Block ranges are computed per query span: a decode row, or a prefill segment (the part of one
  request inside one tile); a tile's range is the hull of its segments'.
- The physical->logical page map is 1-D `[num_blocks]`: a physical page has one logical index even
  when the prefix cache shares it, so no `[requests, pool]` map is needed.

Everything shape-determining (how many decode rows, prefill tiles and segments) is computed on the
host from `query_lens`/`seq_lens`, which the scheduler knows; the device work is pure tensor ops with
no sync. The host half, the plan, is attention/layout.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..masks import kv_bounds_of
from .layout import KV_TILE, StepLayout
from .staging import to_device


@dataclass
class AttentionMetadata:
    """Everything every attention layer of one step reads; built once, shared by all layers."""
    layout: StepLayout
    block_size: int
    num_blocks: int
    seq_lens: torch.Tensor          # int32 [R]
    block_tables: torch.Tensor      # int32 [R, M]
    slot_mapping: torch.Tensor      # int64 [T]; where each new token's K/V is written
    phys_to_logical: torch.Tensor   # int32 [num_blocks]; logical page index of each physical page
    # Device copies of the layout (int64, so they index directly; bool for span_valid and tile_single).
    decode_req: torch.Tensor
    span_req: torch.Tensor
    span_q_lo: torch.Tensor
    span_q_hi: torch.Tensor
    span_valid: torch.Tensor
    span_split: torch.Tensor
    span_kv0: torch.Tensor
    seg_tile: torch.Tensor
    tile_single: torch.Tensor
    prefill_req: torch.Tensor
    prefill_pos: torch.Tensor
    prefill_kv0: torch.Tensor
    decode_src: torch.Tensor
    decode_dst: torch.Tensor
    ws_req: torch.Tensor
    ws_page: torch.Tensor
    ws_src: torch.Tensor            # int64 [workspace pages]; the physical page each one copies, -1: none
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # per-request mod parameters [R]
    backend: object = None
    backend_state: dict = field(default_factory=dict)  # built by the backend in prepare()


def build_phys_to_logical(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                          num_blocks: int) -> torch.Tensor:
    """Scatter each used block-table entry's column index into a [num_blocks] map, no host sync.

    Entries past a request's last page are garbage and go to a spill slot that is dropped.
    """
    R, M = block_tables.shape
    used = torch.arange(M, device=block_tables.device)[None, :] < (
        (seq_lens[:, None] + block_size - 1) // block_size)
    phys = torch.where(used, block_tables.long().clamp(0, num_blocks - 1), num_blocks)
    logical = torch.arange(M, device=block_tables.device, dtype=torch.int32).expand(R, M)
    p2l = torch.zeros(num_blocks + 1, dtype=torch.int32, device=block_tables.device)
    p2l.scatter_(0, phys.flatten(), logical.flatten())
    return p2l[:num_blocks]


LAYOUT_FIELDS = ("decode_req", "span_req", "span_q_lo", "span_q_hi", "span_valid", "span_split", "span_kv0",
                 "seg_tile", "tile_single", "prefill_req", "prefill_pos", "prefill_kv0", "decode_src", "decode_dst",
                 "ws_req", "ws_page")


def build_metadata(block_tables: torch.Tensor, seq_lens: torch.Tensor, slot_mapping: torch.Tensor,
                   layout: StepLayout, block_size: int, num_blocks: int,
                   params: dict[str, torch.Tensor] | None = None) -> AttentionMetadata:
    """Ship the layout in ONE host→device copy (pinned on CUDA), then build the page map on the device."""
    arrays = [np.asarray(getattr(layout, f), dtype=np.int64) for f in LAYOUT_FIELDS]
    packed = to_device(np.concatenate(arrays), block_tables.device)
    views = dict(zip(LAYOUT_FIELDS, packed.split([len(a) for a in arrays])))
    return metadata_on_device(layout, views, block_tables, seq_lens, slot_mapping, block_size, num_blocks, params)


def metadata_on_device(layout: StepLayout, views: dict[str, torch.Tensor], block_tables: torch.Tensor,
                       seq_lens: torch.Tensor, slot_mapping: torch.Tensor, block_size: int, num_blocks: int,
                       params: dict[str, torch.Tensor] | None = None) -> AttentionMetadata:
    """The metadata from the layout arrays already on the device (int64, one per LAYOUT_FIELDS name):
    device ops only, so a CUDA graph can hold it (compile/mixed_graphs.py)."""
    views = {**views, "span_valid": views["span_valid"].bool(), "tile_single": views["tile_single"].bool()}
    return AttentionMetadata(
        layout=layout, block_size=block_size, num_blocks=num_blocks,
        seq_lens=seq_lens, block_tables=block_tables, slot_mapping=slot_mapping,
        phys_to_logical=build_phys_to_logical(block_tables, seq_lens, block_size, num_blocks),
        ws_src=workspace_sources(block_tables, views["ws_req"], views["ws_page"], num_blocks),
        params=dict(params or {}), **views)


def workspace_sources(block_tables: torch.Tensor, ws_req: torch.Tensor, ws_page: torch.Tensor,
                      num_blocks: int) -> torch.Tensor:
    """The physical page each workspace page copies; -1 for padding, which no tile reads."""
    M = block_tables.shape[1]
    phys = block_tables[ws_req, ws_page.clamp(0, M - 1)].long().clamp(0, num_blocks - 1)
    return torch.where(ws_page >= 0, phys, -1)


def block_ranges(meta: AttentionMetadata, mask_mod, param_values: list[torch.Tensor], rows, B: int):
    """For the query spans `rows` (a slice or an index): the logical block ranges, in blocks of B tokens, that the
    mask reads: partial blocks [lo, flo) ∪ [fhi, hi) and full blocks [flo, fhi).

    They come from the mask's logical `kv_bounds` (any-true and all-true token ranges), clipped to the
    request's context; a mask without bounds visits all its blocks (up to the tile's last query when it
    is causal_safe) as partial."""
    req = meta.span_req[rows]
    L = meta.seq_lens.long()[req]
    q_lo, q_hi = meta.span_q_lo[rows], meta.span_q_hi[rows]
    zero = torch.zeros_like(L)
    a_lo, a_hi, f_lo, f_hi = (torch.as_tensor(x, device=L.device).long().expand_as(L)
                              for x in kv_bounds_of(mask_mod)(req, q_lo, q_hi, L, *param_values))
    a_lo, a_hi = a_lo.clamp(min=0), torch.minimum(a_hi, L)
    f_lo, f_hi = torch.maximum(f_lo, a_lo), torch.minimum(f_hi, a_hi)
    valid = meta.span_valid[rows] & (a_hi > a_lo)
    lo = torch.where(valid, a_lo // B, zero)
    hi = torch.where(valid, (a_hi + B - 1) // B, zero)
    flo, fhi = (f_lo + B - 1) // B, f_hi // B  # only blocks wholly inside the all-true range
    no_full = fhi <= flo
    flo = torch.where(no_full, hi, flo.clamp(lo, hi))
    fhi = torch.where(no_full, hi, fhi.clamp(flo, hi))
    return lo, flo, fhi, hi


def block_lists(lo, flo, fhi, hi, M: int):
    """Block ranges → (partial count, [N, M] partial list, full count, [N, M] full list) as logical
    block indices; entries past a count are never read, but still made valid indices by the caller."""
    j = torch.arange(M, device=lo.device)[None, :]
    n_left = (flo - lo)[:, None]
    partial = torch.where(j < n_left, lo[:, None] + j, fhi[:, None] + j - n_left)
    full = flo[:, None] + j
    return ((flo - lo) + (hi - fhi)).int(), partial, (fhi - flo).int(), full


# Decode rows of one program each list the pages the mask keeps whole apart (flex's template then evaluates the mask
# only on the others, in a second loop with its own pipeline start). In steps of at most DECODE_PARTIAL_ROWS decode
# rows every page is partial instead: one loop, the mask everywhere. A batch-32 row reads 2-3 pages, and the second
# pipeline start cost ~20 us a step there on one box, nothing on another (issue 16, scripts/decode_step_probe.py
# decode_partial_rows=N; sessions 39-40); 0: never.
# Not on the CPU: Inductor's C++ flex kernel reads the full lists' counts even where the BlockMask has none and does
# not compile (torch 2.13), and the CPU gains nothing from it.
DECODE_PARTIAL_ROWS = 32
PARTIAL_ONLY_ON_CPU = False  # (the lists' test turns it on: eager, no Inductor)


def decode_full_lists(meta: AttentionMetadata) -> bool:
    """Whether the decode rows' BlockMask has full page lists: more than DECODE_PARTIAL_ROWS decode rows (or the
    CPU), and one program a row (flex splits a row's partial list evenly, but its full list by the whole pool's
    length, so one program would read it all)."""
    lay = meta.layout
    # the row count compared last: under dynamo a comparison of a symbolic size is a guard (and a graph each side)
    few = partial_only_for_few_rows(meta) and lay.num_decode * lay.decode_splits <= DECODE_PARTIAL_ROWS
    return lay.kernel_splits == 1 and not few


def keeps_full_lists(meta: AttentionMetadata, device) -> torch.Tensor:
    """decode_full_lists as a 0-d bool tensor, for traced code: made from the layout's sizes by tensor ops, so that
    dynamo guards on none of them (each comparison of a symbolic size was a graph more of the page lists: 5 graphs on a
    fresh start, session 47, where one row, split rows, kernel splits and few rows each took their own)."""
    lay = meta.layout
    keep = torch.scalar_tensor(lay.kernel_splits, device=device) == 1
    if partial_only_for_few_rows(meta):
        keep &= torch.scalar_tensor(lay.num_decode * lay.decode_splits, device=device) > DECODE_PARTIAL_ROWS
    return keep


def partial_only_for_few_rows(meta: AttentionMetadata) -> bool:
    """Whether steps of up to DECODE_PARTIAL_ROWS decode rows list every page as partial on this device."""
    return DECODE_PARTIAL_ROWS > 0 and (meta.block_tables.is_cuda or PARTIAL_ONLY_ON_CPU)


def page_lists(meta: AttentionMetadata, mask_mod, param_values: list[torch.Tensor], extra_row: bool = False):
    """Per decode row: the partial and the full page lists for `mask_mod`, as flex kv_* tensors [rows, M],
    logical pages mapped through the block table (so no page of another request can appear). `extra_row`: one row
    more, listed from the next span (or the last one again): valid page ids, which nothing reads."""
    S = meta.layout.decode_splits
    rows = slice(0, meta.layout.num_decode * S)
    if extra_row:  # (an index, not a comparison of sizes: dynamo would guard on it)
        rows = torch.arange(rows.stop + 1, device=meta.span_req.device).clamp(max=meta.span_req.shape[0] - 1)
    lo, flo, fhi, hi = block_ranges(meta, mask_mod, param_values, rows, meta.block_size)
    # decode row s of a request reads the s-th contiguous slice of its page range; unsplit rows (S = 1, their
    # span_split 0) the whole range: one formula, no branch on S for dynamo to guard
    chunk = (hi - lo + S - 1) // S
    lo = (lo + meta.span_split[rows] * chunk).clamp(max=hi)
    hi = (lo + chunk).clamp(max=hi)
    flo, fhi = flo.clamp(lo, hi), fhi.clamp(lo, hi)
    fhi = torch.maximum(fhi, flo)
    keep = keeps_full_lists(meta, lo.device)  # otherwise every page partial
    flo, fhi = torch.where(keep, flo, hi), torch.where(keep, fhi, hi)
    M = meta.block_tables.shape[1]
    kv_num, partial, full_num, full = block_lists(lo, flo, fhi, hi, M)
    tables = meta.block_tables[meta.span_req[rows]]
    nb = meta.num_blocks - 1
    kv_idx = tables.gather(1, partial.clamp(0, M - 1)).clamp(0, nb).int()
    full_idx = tables.gather(1, full.clamp(0, M - 1)).clamp(0, nb).int()
    return kv_num, kv_idx, full_num, full_idx


def tile_page_lists(meta: AttentionMetadata, mask_mod, param_values: list[torch.Tensor], capacity: int,
                    group: int = 1):
    """Per q block of `group` prefill tiles (FA4's wider tiles need blocks of several: prefill_kernel.fa4_q_tiles),
    of a step whose pages are KV_TILE tokens, read in place (no workspace): the partial and the full page lists over
    the pool, [blocks, capacity]. A block lists its segments' pages one after another; a page two of its segments
    list (a cached prefix, or one request's pages in consecutive tiles) is listed once (the mask then finds whose row
    may read it). A block has full pages only where its segments are of one request, and only those full for each
    of them, since a block all-true for one request's rows is dead for another's. `capacity` bounds the distinct
    pages of a block (the workspace's pages do)."""
    lay, P = meta.layout, meta.block_size
    blocks = -(-lay.num_tiles // group)
    if lay.num_segments == 0:  # tiles of padding alone
        counts, lists = meta.block_tables.new_zeros(blocks), meta.block_tables.new_zeros(blocks, capacity)
        return counts, lists, counts, lists
    first = lay.num_decode * lay.decode_splits
    rows = slice(first, first + lay.num_segments)
    lo, flo, fhi, hi = block_ranges(meta, mask_mod, param_values, rows, P)
    tables, req = meta.block_tables, meta.span_req[rows]
    seg_block = meta.seg_tile // group  # padding segments sit in tile 0, hold nothing and are kept out below
    lead = None  # (group > 1) the segments whose full pages stand for their block's
    if group == 1:
        single = meta.tile_single[meta.seg_tile]
    else:  # one request per block, its full range where every segment's is full (a segment without keys: none)
        valid = meta.span_valid[rows]

        def per_block(values, reduce, init):
            out = torch.full((blocks,), init, dtype=torch.long, device=lo.device)
            return out.scatter_reduce_(0, seg_block, torch.where(valid, values, init), reduce)[seg_block]

        big = 1 << 40
        single = valid & (per_block(req, "amin", big) == per_block(req, "amax", -1))
        flo, fhi = per_block(flo, "amax", 0), per_block(fhi, "amin", big)
        single = single & (fhi > flo)
        lead = torch.ones_like(valid)  # each block's full list comes from its first segment
        lead[1:] = seg_block[1:] != seg_block[:-1]
    flo, fhi = torch.where(single, flo, hi), torch.where(single, fhi, hi)
    n_left = flo - lo
    M, none = tables.shape[1], meta.num_blocks  # `none`: past every page, so it sorts last
    width = group * capacity  # one request's pages listed by each of its segments in a block, before repeats go

    def per_tile(counts, logical):  # the segments' blocks (logical(segment, k) for k < count), concatenated per block
        end = counts.cumsum(0)
        start = end - counts
        tile_count = torch.zeros(blocks, dtype=torch.long, device=lo.device).scatter_add_(0, seg_block, counts)
        tile_start = tile_count.cumsum(0) - tile_count  # real segments come in tile order; padding ones hold nothing
        j = torch.arange(width, device=lo.device)[None, :]
        g = tile_start[:, None] + j
        seg = torch.searchsorted(end, g, right=True).clamp(max=len(counts) - 1)
        pages = tables[req[seg], logical(seg, g - start[seg]).clamp(0, M - 1)].long().clamp(0, none - 1)
        return torch.where(j < tile_count[:, None], pages, none), tile_count

    partial, kv_num = per_tile(n_left + (hi - fhi), lambda s, k: torch.where(k < n_left[s], lo[s] + k,
                                                                             fhi[s] + k - n_left[s]))
    full_counts = fhi - flo if lead is None else torch.where(lead, fhi - flo, 0)
    full, full_num = per_tile(full_counts, lambda s, k: flo[s] + k)
    # A shared page appears once per segment that reads it: sort, drop repeats, and sort them to the end.
    partial = partial.sort(dim=1).values
    repeat = torch.zeros_like(partial, dtype=torch.bool)
    repeat[:, 1:] = partial[:, 1:] == partial[:, :-1]
    partial = torch.where(repeat, none, partial).sort(dim=1).values[:, :capacity]
    full = full[:, :capacity]
    kv_num = (partial < none).sum(1)
    return (kv_num.int(), torch.where(partial < none, partial, 0).int(), full_num.int(),
            torch.where(full < none, full, 0).int())


def workspace_lists(meta: AttentionMetadata, mask_mod, param_values: list[torch.Tensor], capacity_blocks: int):
    """Per prefill tile: the partial and the full KV_TILE block lists over the workspace, [tiles,
    capacity_blocks]. A tile reads the hull of its segments' ranges (each its request's logical blocks
    shifted by where the request's context starts there); only a tile of one segment has full blocks,
    since a block all-true for one request's rows is dead for another's."""
    lay = meta.layout
    first = lay.num_decode * lay.decode_splits
    rows = slice(first, first + lay.num_segments)
    lo, flo, fhi, hi = block_ranges(meta, mask_mod, param_values, rows, KV_TILE)
    base = meta.span_kv0[rows] // KV_TILE
    some = hi > lo
    single = some & meta.tile_single[meta.seg_tile]
    top = capacity_blocks

    def hull(values, keep, reduce):  # per tile, over its segments; padding segments sit in tile 0, kept out
        init = top if reduce == "amin" else 0
        out = torch.full((lay.num_tiles,), init, dtype=torch.long, device=lo.device)
        return out.scatter_reduce_(0, meta.seg_tile, torch.where(keep, values + base, init), reduce)

    t_lo, t_hi = hull(lo, some, "amin"), hull(hi, some, "amax")
    empty = t_hi <= t_lo
    t_lo, t_hi = torch.where(empty, 0, t_lo), torch.where(empty, 0, t_hi)
    t_flo = hull(flo, single, "amin").clamp(t_lo, t_hi)
    t_fhi = torch.maximum(hull(fhi, single, "amax").clamp(max=t_hi), t_flo)
    no_full = t_fhi <= t_flo
    t_flo, t_fhi = torch.where(no_full, t_hi, t_flo), torch.where(no_full, t_hi, t_fhi)
    kv_num, partial, full_num, full = block_lists(t_lo, t_flo, t_fhi, t_hi, capacity_blocks)
    return kv_num, partial.clamp(0, top - 1).int(), full_num, full.clamp(0, top - 1).int()
