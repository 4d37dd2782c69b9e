"""The once-per-step attention metadata: where each query sits, and which pages each query tile reads.

Layout (chosen by measurement, see docs/benchmarks.md and DESIGN.md's baselines):
- The KV pool of a layer is viewed as ONE sequence `[1, Hkv, num_blocks * block_size, D]`, and the
  flex KV block equals the page, so a block table row IS a list of flex kv block indices. No copy of
  K/V, and physical placement never changes which keys a tile sees.
- Decode rows (query_len == 1) get one flex batch row each: `[Bd, Hq, 1, D]`, the shape the flex
  decoding kernel (split-KV, GQA-packed) wants. Each row's BlockMask lists exactly its own pages.
- Prefill rows are packed into 128-query tiles that never mix requests: `[1, Hq, Tp * 128, D]`.
  Padding is at most one tile per prefilling request, so memory grows with the step's tokens, not
  with requests x longest prompt (one-row-per-request prefill would pad every row to the longest).
- Prefill tiles do not read the pool. The pages of each prefilling request are first copied, in
  logical order, into a contiguous workspace (`plan_layout(block_size=...)` lays it out), each request
  starting on a KV_TILE boundary: the kernel then reads 128-token KV blocks whatever the page size
  (16-token pages capped its tile at 16), the blocks of a tile are a contiguous range computed
  from the request's offset (no block-table gathers, tables sized by the workspace, not the pool),
  and a block wholly inside the mask's all-true range is a full block.
- The physical->logical page map is 1-D `[num_blocks]`: a physical page has one logical index even
  when the prefix cache shares it, so no `[requests, pool]` map is needed.

Everything shape-determining (how many decode rows and prefill tiles) is computed on the host from
`query_lens`/`seq_lens`, which the scheduler knows; the device work is pure tensor ops with no sync.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ..masks import kv_bounds_of

Q_TILE = 128  # flex q block for prefill tiles; one tile never holds two requests
KV_TILE = 128  # flex kv block of the prefill call, over the workspace


def workspace_align(block_size: int) -> int:
    """Tokens a request's workspace span is rounded up to: whole pages and whole KV tiles."""
    return math.lcm(block_size, KV_TILE)


def workspace_tokens(query_lens, seq_lens, block_size: int) -> int:
    """Workspace tokens a step needs: each prefilling request's context, rounded up to the alignment."""
    a = workspace_align(block_size)
    return sum(-(-L // a) * a for n, L in zip(query_lens, seq_lens) if n > 1)


@dataclass
class StepLayout:
    """Host-computed placement of the step's query tokens in the flex calls."""
    query_lens: list[int]
    seq_lens: list[int]
    num_tokens: int
    num_decode: int            # decode requests, padding included
    decode_splits: int         # split-KV: each decode request is this many rows over slices of its pages
    num_tiles: int             # prefill tiles, padding included
    # Per tile (decode rows first, num_decode * decode_splits of them, then prefill tiles): request,
    # first and last logical query position, which split of the request's pages it reads.
    tile_req: np.ndarray
    tile_q_lo: np.ndarray
    tile_q_hi: np.ndarray
    tile_valid: np.ndarray
    tile_split: np.ndarray
    # Per query row of the prefill call (num_tiles * Q_TILE rows).
    prefill_req: np.ndarray
    prefill_pos: np.ndarray
    prefill_src: np.ndarray    # packed token index to read the query from (padding reads token 0)
    # Per packed token, plus one spill row (num_tokens + 1): the prefill output row that holds it. The output
    # is gathered (a gather ran at 2.2x the speed of index_copy_ on the H100); decode tokens are then
    # overwritten, and a mixed graph's padded tokens read row 0, so they stay finite.
    token_row: np.ndarray
    decode_src: np.ndarray     # per decode row (num_decode * decode_splits)
    decode_dst: np.ndarray     # per decode request
    # The prefill workspace (empty without block_size): each gathered page's request and logical page
    # (padding pages: page -1, which gathers page 0 and is never read), and per prefill row and per
    # tile (decode rows: 0) the workspace token where its request's context starts.
    ws_req: np.ndarray = None
    ws_page: np.ndarray = None
    prefill_kv0: np.ndarray = None
    tile_kv0: np.ndarray = None
    # The step's tokens are followed by padding tokens no tile covers (a mixed CUDA graph's capacity):
    # their attention rows must still be defined, or they carry garbage into the K/V they write.
    padded_tokens: bool = False

    @property
    def decode_req(self) -> np.ndarray:
        """Request of each decode row: its own array, so the decode kernel's inputs never change shape
        with the number of prefill tiles."""
        return self.tile_req[: self.num_decode * self.decode_splits]


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
                pad_workspace_to: int = 0) -> StepLayout:
    """Place each request's queries: query_len 1 → decode rows, longer → whole prefill tiles; with
    `block_size`, also the prefill workspace (pages, padded to `pad_workspace_to` pages)."""
    assert decode_splits >= 1 and len(query_lens) > 0
    ql = np.asarray(query_lens, dtype=np.int64)
    sl = np.asarray(seq_lens, dtype=np.int64)
    T = int(ql.sum())
    starts = np.concatenate([[0], np.cumsum(ql)[:-1]]).astype(np.int64)
    dec = np.nonzero(ql == 1)[0]
    pre = np.nonzero(ql > 1)[0]
    Bd = max(len(dec), pad_decode_to)
    tiles_per = (ql[pre] + Q_TILE - 1) // Q_TILE
    Tp = max(int(tiles_per.sum()), pad_tiles_to)

    dec_pad = Bd - len(dec)
    decode_src = np.repeat(np.concatenate([starts[dec], np.zeros(dec_pad, np.int64)]), decode_splits)
    decode_dst = np.concatenate([starts[dec], np.full(dec_pad, T, np.int64)])

    # Prefill tiles: tile k of request i covers its queries k*Q_TILE .. (k+1)*Q_TILE - 1.
    t_req = np.repeat(pre, tiles_per)
    t_k = np.arange(len(t_req)) - np.repeat(np.cumsum(tiles_per) - tiles_per, tiles_per)
    ctx = sl - ql  # logical position of each request's first new token
    t_lo = ctx[t_req] + t_k * Q_TILE
    t_hi = np.minimum(t_lo + Q_TILE, sl[t_req]) - 1

    # Padding tiles (to pad_tiles_to) belong to request 0 and hold no valid row.
    tile_pad = Tp - len(t_req)
    z = lambda n: np.zeros(n, np.int64)  # noqa: E731
    tile_of_row = np.arange(Tp * Q_TILE) // Q_TILE
    row_req = np.concatenate([t_req, z(tile_pad)])[tile_of_row]
    row_k = np.arange(Tp * Q_TILE) % Q_TILE + np.concatenate([t_k, z(tile_pad)])[tile_of_row] * Q_TILE
    row_valid = (tile_of_row < len(t_req)) & (row_k < ql[row_req])
    prefill_src = np.where(row_valid, starts[row_req] + row_k, 0)
    token_row = np.zeros(T + 1, np.int64)
    token_row[prefill_src[row_valid]] = np.nonzero(row_valid)[0]
    # a padding row reads as its request's last token: the user's mod sees only real positions
    prefill_pos = np.minimum(ctx[row_req] + row_k, sl[row_req] - 1)

    ws = plan_workspace(ql, sl, pre, block_size, pad_workspace_to)
    kv0_req = np.zeros(len(ql), np.int64)
    if ws is not None:
        kv0_req[pre] = ws[2]
    ws_req, ws_page = (ws[0], ws[1]) if ws is not None else (z(0), z(0))

    S = decode_splits
    dreq = np.repeat(np.concatenate([dec, z(dec_pad)]), S)
    dpos = np.repeat(np.concatenate([sl[dec] - 1, z(dec_pad)]), S)
    return StepLayout(
        query_lens=[int(x) for x in ql], seq_lens=[int(x) for x in sl], num_tokens=T,
        num_decode=Bd, decode_splits=S, num_tiles=Tp,
        tile_req=np.concatenate([dreq, t_req, z(tile_pad)]),
        tile_q_lo=np.concatenate([dpos, t_lo, z(tile_pad)]),
        tile_q_hi=np.concatenate([dpos, t_hi, z(tile_pad)]),
        tile_valid=np.concatenate([np.repeat(np.arange(Bd) < len(dec), S), np.ones(len(t_req), bool),
                                   np.zeros(tile_pad, bool)]),
        tile_split=np.concatenate([np.tile(np.arange(S), Bd), z(len(t_req) + tile_pad)]),
        prefill_req=row_req, prefill_pos=prefill_pos, prefill_src=prefill_src, token_row=token_row,
        decode_src=decode_src, decode_dst=decode_dst,
        ws_req=ws_req, ws_page=ws_page, prefill_kv0=kv0_req[row_req],
        tile_kv0=np.concatenate([z(Bd * S), kv0_req[t_req], z(tile_pad)]),
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
    # Device copies of the layout (int64, so they index directly).
    decode_req: torch.Tensor
    tile_req: torch.Tensor
    tile_q_lo: torch.Tensor
    tile_q_hi: torch.Tensor
    tile_valid: torch.Tensor
    tile_split: torch.Tensor
    prefill_req: torch.Tensor
    prefill_pos: torch.Tensor
    prefill_src: torch.Tensor
    token_row: torch.Tensor
    decode_src: torch.Tensor
    decode_dst: torch.Tensor
    ws_req: torch.Tensor
    ws_page: torch.Tensor
    prefill_kv0: torch.Tensor
    tile_kv0: torch.Tensor
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


LAYOUT_FIELDS = ("decode_req", "tile_req", "tile_q_lo", "tile_q_hi", "tile_valid", "tile_split", "prefill_req", "prefill_pos",
                  "prefill_src", "token_row", "decode_src", "decode_dst", "ws_req", "ws_page", "prefill_kv0",
                  "tile_kv0")


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
    views = {**views, "tile_valid": views["tile_valid"].bool()}
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
    """For the tiles `rows`: the logical block ranges, in blocks of B tokens, that the mask reads:
    partial blocks [lo, flo) ∪ [fhi, hi) and full blocks [flo, fhi).

    They come from the mask's logical `kv_bounds` (any-true and all-true token ranges), clipped to the
    request's context; a mask without bounds visits all its blocks (up to the tile's last query when it
    is causal_safe) as partial."""
    req = meta.tile_req[rows]
    L = meta.seq_lens.long()[req]
    q_lo, q_hi = meta.tile_q_lo[rows], meta.tile_q_hi[rows]
    zero = torch.zeros_like(L)
    a_lo, a_hi, f_lo, f_hi = (torch.as_tensor(x, device=L.device).long().expand_as(L)
                              for x in kv_bounds_of(mask_mod)(req, q_lo, q_hi, L, *param_values))
    a_lo, a_hi = a_lo.clamp(min=0), torch.minimum(a_hi, L)
    f_lo, f_hi = torch.maximum(f_lo, a_lo), torch.minimum(f_hi, a_hi)
    valid = meta.tile_valid[rows] & (a_hi > a_lo)
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
        lo = (lo + meta.tile_split[rows] * chunk).clamp(max=hi)
        hi = (lo + chunk).clamp(max=hi)
        flo, fhi = flo.clamp(lo, hi), fhi.clamp(lo, hi)
        fhi = torch.maximum(fhi, flo)
    M = meta.block_tables.shape[1]
    kv_num, partial, full_num, full = block_lists(lo, flo, fhi, hi, M)
    tables = meta.block_tables[meta.tile_req[rows]]
    nb = meta.num_blocks - 1
    kv_idx = tables.gather(1, partial.clamp(0, M - 1)).clamp(0, nb).int()
    full_idx = tables.gather(1, full.clamp(0, M - 1)).clamp(0, nb).int()
    return kv_num, kv_idx, full_num, full_idx


def workspace_lists(meta: AttentionMetadata, mask_mod, param_values: list[torch.Tensor], capacity_blocks: int):
    """Per prefill tile: the partial and the full KV_TILE block lists over the workspace, [tiles,
    capacity_blocks]: the request's logical blocks shifted by where its context starts there."""
    first = meta.layout.num_decode * meta.layout.decode_splits
    rows = slice(first, first + meta.layout.num_tiles)
    lo, flo, fhi, hi = block_ranges(meta, mask_mod, param_values, rows, KV_TILE)
    kv_num, partial, full_num, full = block_lists(lo, flo, fhi, hi, capacity_blocks)
    base = (meta.tile_kv0[rows] // KV_TILE)[:, None]
    top = capacity_blocks - 1
    return kv_num, (partial + base).clamp(0, top).int(), full_num, (full + base).clamp(0, top).int()
