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
- Prefill tiles do not read the pool. The pages of each prefilling request are first copied, in
  logical order, into a contiguous workspace (`plan_layout(block_size=...)` lays it out), each request
  starting on a KV_TILE boundary: the kernel then reads 128-token KV blocks whatever the page size
  (16-token pages capped its tile at 16), and the blocks a tile reads are one contiguous range: from
  its first request's lowest to its last request's highest (requests lie in the workspace in token
  order). A tile of one request also gets full blocks, those wholly inside the mask's all-true range.
- Block ranges are computed per query span: a decode row, or a prefill segment (the part of one
  request inside one tile); a tile's range is the hull of its segments'.
- The physical->logical page map is 1-D `[num_blocks]`: a physical page has one logical index even
  when the prefix cache shares it, so no `[requests, pool]` map is needed.

Everything shape-determining (how many decode rows, prefill tiles and segments) is computed on the
host from `query_lens`/`seq_lens`, which the scheduler knows; the device work is pure tensor ops with
no sync.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ..masks import kv_bounds_of

Q_TILE = 128  # flex q block of the prefill call
KV_TILE = 128  # flex kv block of the prefill call, over the workspace
DEAD_KV0 = 1 << 30  # workspace start of a row that is not a prefill query: every key lies before it


def workspace_align(block_size: int) -> int:
    """Tokens a request's workspace span is rounded up to: whole pages and whole KV tiles."""
    return math.lcm(block_size, KV_TILE)


def workspace_tokens(query_lens, seq_lens, block_size: int) -> int:
    """Workspace tokens a step needs: each prefilling request's context, rounded up to the alignment."""
    a = workspace_align(block_size)
    return sum(-(-L // a) * a for n, L in zip(query_lens, seq_lens) if n > 1)


def segment_capacity(num_tiles: int, max_requests: int) -> int:
    """Most prefill segments `num_tiles` tiles can hold: one per tile, plus one per request boundary
    inside them (a prefill request has at least two tokens)."""
    return num_tiles + min(max_requests, num_tiles * Q_TILE // 2)


@dataclass
class StepLayout:
    """Host-computed placement of the step's query tokens in the flex calls."""
    query_lens: list[int]
    seq_lens: list[int]
    num_tokens: int
    num_decode: int            # decode requests, padding included
    decode_splits: int         # split-KV: each decode request is this many rows over slices of its pages
    num_tiles: int             # prefill tiles over the token buffer, padding included
    num_segments: int          # prefill segments, padding included
    # Per query span (decode rows first, num_decode * decode_splits of them, then the prefill segments):
    # request, first and last logical query position, whether it holds queries, which split of the
    # request's pages it reads (decode), where its request's context starts in the workspace (prefill).
    span_req: np.ndarray
    span_q_lo: np.ndarray
    span_q_hi: np.ndarray
    span_valid: np.ndarray
    span_split: np.ndarray
    span_kv0: np.ndarray
    seg_tile: np.ndarray       # per prefill segment: its tile
    tile_single: np.ndarray    # per tile: it holds one segment (so it may have full blocks)
    # Per row of the prefill call (num_tiles * Q_TILE): request, logical position and workspace start
    # (DEAD_KV0 for a row that is not a prefill query). Dead rows still name a request with tokens and
    # a position inside it: the user's mod only ever sees real coordinates.
    prefill_req: np.ndarray
    prefill_pos: np.ndarray
    prefill_kv0: np.ndarray
    decode_src: np.ndarray     # per decode row (num_decode * decode_splits): the token it reads
    decode_dst: np.ndarray     # per decode request: the token row its output goes to; padding: -1
    # The prefill workspace (empty without block_size): each gathered page's request and logical page
    # (padding pages: page -1, which gathers page 0 and is never read).
    ws_req: np.ndarray = None
    ws_page: np.ndarray = None

    @property
    def decode_req(self) -> np.ndarray:
        """Request of each decode row: its own array, so the decode kernel's inputs never change shape
        with the number of prefill segments."""
        return self.span_req[: self.num_decode * self.decode_splits]

    @property
    def token_capacity(self) -> int:
        """Rows of the token buffer: whole prefill tiles when there are any."""
        return max(self.num_tokens, self.num_tiles * Q_TILE)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_decode_splits(num_decode: int, num_kv_heads: int, device) -> int:
    """Enough split-KV rows to give every SM about two (row, kv-head) programs; 1 at large batch.

    Always 1 off CUDA: merging splits needs the kernel's log-sum-exp, which CPU Inductor lacks.
    """
    device = torch.device(device)
    if device.type != "cuda" or num_decode == 0:
        return 1
    return max(1, min(32, (2 * _num_sms(device)) // (num_decode * num_kv_heads)))


def plan_layout(query_lens: list[int], seq_lens: list[int], pad_decode_to: int = 0,
                pad_tiles_to: int = 0, decode_splits: int = 1, block_size: int | None = None,
                pad_workspace_to: int = 0, pad_segments_to: int = 0) -> StepLayout:
    """Place each request's queries: query_len 1 → decode rows, longer → prefill rows of the token
    buffer's tiles; with `block_size`, also the prefill workspace (pages, padded to `pad_workspace_to`)."""
    assert decode_splits >= 1 and len(query_lens) > 0
    ql = np.asarray(query_lens, dtype=np.int64)
    sl = np.asarray(seq_lens, dtype=np.int64)
    T = int(ql.sum())
    starts = np.concatenate([[0], np.cumsum(ql)[:-1]]).astype(np.int64)
    ends = starts + ql
    ctx = sl - ql  # logical position of each request's first new token
    dec = np.nonzero(ql == 1)[0]
    pre = np.nonzero(ql > 1)[0]
    z = lambda n: np.zeros(n, np.int64)  # noqa: E731

    Bd = max(len(dec), pad_decode_to)
    dec_pad = Bd - len(dec)
    S = decode_splits
    decode_src = np.repeat(np.concatenate([starts[dec], z(dec_pad)]), S)
    decode_dst = np.concatenate([starts[dec], np.full(dec_pad, -1, np.int64)])
    dreq = np.repeat(np.concatenate([dec, z(dec_pad)]), S)
    dpos = np.repeat(np.concatenate([sl[dec] - 1, z(dec_pad)]), S)

    Tp = max(-(-T // Q_TILE), pad_tiles_to) if len(pre) or pad_tiles_to else 0
    # Segments: request i's tokens [starts, ends) cut at tile boundaries.
    first_tile, last_tile = starts[pre] // Q_TILE, (ends[pre] - 1) // Q_TILE
    per_req = last_tile - first_tile + 1
    seg_req = np.repeat(pre, per_req)
    seg_k = np.arange(len(seg_req)) - np.repeat(np.cumsum(per_req) - per_req, per_req)  # k-th tile of its request
    seg_tile = np.repeat(first_tile, per_req) + seg_k
    tok_lo = np.maximum(starts[seg_req], seg_tile * Q_TILE)
    tok_hi = np.minimum(ends[seg_req], (seg_tile + 1) * Q_TILE) - 1
    seg_q_lo = ctx[seg_req] + tok_lo - starts[seg_req]
    seg_q_hi = ctx[seg_req] + tok_hi - starts[seg_req]
    Ns = max(len(seg_req), pad_segments_to)
    seg_pad = Ns - len(seg_req)  # padding segments: tile 0, no queries
    tile_single = np.bincount(seg_tile, minlength=Tp)[:Tp] == 1

    ws = plan_workspace(ql, sl, pre, block_size, pad_workspace_to)
    kv0_req = np.zeros(len(ql), np.int64)
    if ws is not None:
        kv0_req[pre] = ws[2]
    ws_req, ws_page = (ws[0], ws[1]) if ws is not None else (z(0), z(0))

    # Rows of the prefill call: the token buffer, then padding. A dead row (a decode token's, padding)
    # reads as the first prefilling request's last position, which has a token whatever the buffers say.
    R = Tp * Q_TILE
    row = np.arange(R)
    row_req = np.repeat(np.arange(len(ql)), ql)[np.minimum(row, T - 1)]
    live = (row < T) & (ql[row_req] > 1)
    filler = pre[0] if len(pre) else 0
    row_pos = np.where(live, ctx[row_req] + row - starts[row_req], sl[filler] - 1)
    row_req = np.where(live, row_req, filler)
    row_kv0 = np.where(live, kv0_req[row_req], DEAD_KV0)

    return StepLayout(
        query_lens=ql.tolist(), seq_lens=sl.tolist(), num_tokens=T,
        num_decode=Bd, decode_splits=S, num_tiles=Tp, num_segments=Ns,
        span_req=np.concatenate([dreq, seg_req, z(seg_pad)]),
        span_q_lo=np.concatenate([dpos, seg_q_lo, z(seg_pad)]),
        span_q_hi=np.concatenate([dpos, seg_q_hi, z(seg_pad)]),
        span_valid=np.concatenate([np.repeat(np.arange(Bd) < len(dec), S), np.ones(len(seg_req), bool),
                                   np.zeros(seg_pad, bool)]),
        span_split=np.concatenate([np.tile(np.arange(S), Bd), z(Ns)]),
        span_kv0=np.concatenate([z(Bd * S), kv0_req[seg_req], z(seg_pad)]),
        seg_tile=np.concatenate([seg_tile, z(seg_pad)]), tile_single=tile_single,
        prefill_req=row_req, prefill_pos=row_pos, prefill_kv0=row_kv0,
        decode_src=decode_src, decode_dst=decode_dst, ws_req=ws_req, ws_page=ws_page,
    )


def plan_workspace(ql: np.ndarray, sl: np.ndarray, pre: np.ndarray, block_size: int | None, pad_to: int):
    """(request and logical page of each gathered page, workspace start token of each prefilling
    request), or None without a block size. Request i's pages 0 .. ceil(L_i / align) * align / P - 1
    follow each other, so its context is contiguous from a KV_TILE boundary; pages past its last are
    padding (-1), as are the pages that pad the whole to `pad_to`."""
    if block_size is None:
        return None
    P, a = block_size, workspace_align(block_size)
    span = -(-sl[pre] // a) * (a // P)  # pages per request, alignment included
    start = (np.cumsum(span) - span).astype(np.int64)
    n = int(span.sum())
    total = max(n, pad_to)
    req = np.zeros(total, np.int64)
    page = np.full(total, -1, np.int64)
    req[:n] = np.repeat(pre, span)
    page[:n] = np.arange(n) - np.repeat(start, span)
    used = -(-sl[req[:n]] // P)
    page[:n] = np.where(page[:n] < used, page[:n], -1)
    return req, page, start * P


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


def to_device(array: np.ndarray, device) -> torch.Tensor:
    """One host→device copy, from pinned memory on CUDA so that it does not block the host."""
    t = torch.from_numpy(array)
    device = torch.device(device)
    if device.type != "cuda":
        return t
    if torch.cuda.is_current_stream_capturing() or t.nbytes > PinnedStaging.SLOT_BYTES:
        return t.pin_memory().to(device, non_blocking=True)
    return staging(device).copy(t)


def copy_into(array: np.ndarray, buffer: torch.Tensor, device) -> None:
    """to_device, into the start of an existing buffer (a CUDA graph's static input) on `device`."""
    t = torch.from_numpy(array)
    dst = buffer[: t.numel()].view(t.shape)
    device = torch.device(device)
    if device.type != "cuda":
        dst.copy_(t)
    elif torch.cuda.is_current_stream_capturing() or t.nbytes > PinnedStaging.SLOT_BYTES:
        dst.copy_(t.pin_memory(), non_blocking=True)
    else:
        staging(device).copy(t, out=dst)


class PinnedStaging:
    """A ring of preallocated pinned slots for small host→device copies. Pinning fresh memory for each
    copy (`pin_memory()`) took 12% of the server engine's host time on the H100 box (py-spy). A slot
    is written again only after the copy that last read it has run (an event per slot)."""
    SLOTS, SLOT_BYTES = 32, 1 << 20

    def __init__(self, device: torch.device):
        self.device = device
        self.buffer = torch.empty(self.SLOTS * self.SLOT_BYTES, dtype=torch.uint8, pin_memory=True)
        self.copied: list[torch.cuda.Event | None] = [None] * self.SLOTS
        self.next = 0

    def copy(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """t on the device: a new tensor, or written into `out`."""
        i, self.next = self.next, (self.next + 1) % self.SLOTS
        if self.copied[i] is not None:
            self.copied[i].synchronize()  # long done, unless SLOTS copies are still queued
        start = i * self.SLOT_BYTES
        slot = self.buffer[start:start + t.nbytes].view(t.dtype).view(t.shape)
        slot.copy_(t)
        if out is None:
            out = slot.to(self.device, non_blocking=True)
        else:
            out.copy_(slot, non_blocking=True)
        self.copied[i] = self.copied[i] or torch.cuda.Event()
        self.copied[i].record()
        return out


@functools.cache
def staging(device: torch.device) -> PinnedStaging:
    return PinnedStaging(device)


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


def block_ranges(meta: AttentionMetadata, mask_mod, param_values: list[torch.Tensor], rows: slice, B: int):
    """For the query spans `rows`: the logical block ranges, in blocks of B tokens, that the mask reads:
    partial blocks [lo, flo) ∪ [fhi, hi) and full blocks [flo, fhi).

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


def page_lists(meta: AttentionMetadata, mask_mod, param_values: list[torch.Tensor]):
    """Per decode row: the partial and the full page lists for `mask_mod`, as flex kv_* tensors [rows, M],
    logical pages mapped through the block table (so no page of another request can appear)."""
    S = meta.layout.decode_splits
    rows = slice(0, meta.layout.num_decode * S)
    lo, flo, fhi, hi = block_ranges(meta, mask_mod, param_values, rows, meta.block_size)
    if S > 1:  # decode row s of a request reads the s-th contiguous slice of its page range
        chunk = (hi - lo + S - 1) // S
        lo = (lo + meta.span_split[rows] * chunk).clamp(max=hi)
        hi = (lo + chunk).clamp(max=hi)
        flo, fhi = flo.clamp(lo, hi), fhi.clamp(lo, hi)
        fhi = torch.maximum(fhi, flo)
    M = meta.block_tables.shape[1]
    kv_num, partial, full_num, full = block_lists(lo, flo, fhi, hi, M)
    tables = meta.block_tables[meta.span_req[rows]]
    nb = meta.num_blocks - 1
    kv_idx = tables.gather(1, partial.clamp(0, M - 1)).clamp(0, nb).int()
    full_idx = tables.gather(1, full.clamp(0, M - 1)).clamp(0, nb).int()
    return kv_num, kv_idx, full_num, full_idx


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
