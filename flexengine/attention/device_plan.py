"""plan_layout on the device, for the CUDA graphs of steps with prompt tokens.

The host planned each such step with ~80 numpy operations (plan_layout) and packed positions and slots per
token: 1.2 ms of the H100 box's host time per step at 256 requests, where issue 15 asks for 150 µs
(docs/benchmarks.md, session 24). Here the host sends each request's query and sequence lengths (with the
ids and the block tables) and the graph computes the rest: plan_layout's arrays, each token's position and
slot. Every array is computed at the graph runner's largest size (`PlanCapacity`), so one compiled function
serves every graph key; a key reads the leading part of each array (`key_views`). Its decode shape (padded
decode requests, split-KV rows per request) is a tensor, not a shape, for the same reason.

plan_layout stays the reference: tests/test_device_plan.py checks the two agree on random steps.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import DEAD_KV0, Q_TILE, workspace_align


@dataclass(frozen=True)
class PlanCapacity:
    """The most of each kind of entry any graph key holds."""
    decode_requests: int  # padded decode requests (the largest decode bucket)
    decode_rows: int      # decode requests x split-KV rows, at the key where that is largest
    tiles: int            # prefill tiles
    segments: int         # prefill segments
    workspace_pages: int  # pages gathered into the prefill workspace


def align_pages(block_size: int) -> int:
    """Pages a request's workspace span is rounded up to (layout.workspace_align), on the host: dynamo traces no
    math.lcm of the plan's (symbolic) page size."""
    return workspace_align(block_size) // block_size


def plan_on_device(query_lens: torch.Tensor, seq_lens: torch.Tensor, tables: torch.Tensor,
                   decode_shape: torch.Tensor, cap: PlanCapacity, block_size: int, span_pages: int,
                   scratch_slot: int) -> dict[str, torch.Tensor]:
    """query_lens, seq_lens: int64 [R] (0 for rows past the step's requests); tables: int32 [R, M];
    decode_shape: int64 [2], the key's padded decode requests and rows per request; span_pages: align_pages of
    the page size.

    → plan_layout's arrays (metadata.LAYOUT_FIELDS) and `positions` and `slots` per token row, each at the
    capacity's length; the leading entries are what plan_layout gives for the key's padding."""
    R, dev = query_lens.shape[0], query_lens.device
    P, Q = block_size, Q_TILE
    ql, sl = query_lens, seq_lens
    ends = torch.cumsum(ql, 0)
    starts, ctx = ends - ql, sl - ql
    T = ends[-1]
    is_dec, is_pre = ql == 1, ql > 1

    def request_of(index, cumulative):  # the request whose [cumulative - count, cumulative) holds index
        return torch.bucketize(index, cumulative, right=True).clamp(max=R - 1)

    # Decode requests in batch order, then padding (request 0, no query), each `rows` rows over its splits.
    j = torch.arange(cap.decode_requests, device=dev)
    dvalid = j < is_dec.sum()
    dreq = torch.where(dvalid, request_of(j, torch.cumsum(is_dec.long(), 0)), 0)
    rows = decode_shape[1]
    r = torch.arange(cap.decode_rows, device=dev)
    slot = (r // rows).clamp(max=cap.decode_requests - 1)
    rvalid, row_req = dvalid[slot], dreq[slot]
    decode_src = torch.where(rvalid, starts[row_req], 0)
    row_pos = torch.where(rvalid, sl[row_req] - 1, 0)

    # Prefill segments: request i's tokens cut at tile boundaries, in request order; then padding (tile 0).
    first, last = starts // Q, (ends - 1) // Q
    per_req = torch.where(is_pre, last - first + 1, 0)
    cum_seg = torch.cumsum(per_req, 0)
    k = torch.arange(cap.segments, device=dev)
    sreal = k < cum_seg[-1]
    sreq = request_of(k, cum_seg)
    seg_tile = first[sreq] + k - (cum_seg[sreq] - per_req[sreq])
    tok_lo = torch.maximum(starts[sreq], seg_tile * Q)
    tok_hi = torch.minimum(ends[sreq], (seg_tile + 1) * Q) - 1
    seg_q_lo = torch.where(sreal, ctx[sreq] + tok_lo - starts[sreq], 0)
    seg_q_hi = torch.where(sreal, ctx[sreq] + tok_hi - starts[sreq], 0)
    seg_tile, sreq = torch.where(sreal, seg_tile, 0), torch.where(sreal, sreq, 0)
    per_tile = torch.zeros(cap.tiles + 1, dtype=torch.long, device=dev)
    per_tile.scatter_add_(0, torch.where(sreal, seg_tile, cap.tiles), torch.ones_like(seg_tile))
    tile_single = per_tile[: cap.tiles] == 1

    # The workspace: each prefilling request's pages, its span rounded up to the alignment (plan_workspace).
    a = span_pages * P
    span = torch.where(is_pre, (sl + a - 1) // a * span_pages, 0)
    cum_ws = torch.cumsum(span, 0)
    ws_start = cum_ws - span
    w = torch.arange(cap.workspace_pages, device=dev)
    wreal = w < cum_ws[-1]
    wreq = request_of(w, cum_ws)
    wpage = w - ws_start[wreq]
    ws_page = torch.where(wreal & (wpage < (sl[wreq] + P - 1) // P), wpage, -1)
    kv0_req = torch.where(is_pre, ws_start * P, 0)

    # Token rows (the prefill call's rows): a dead row reads as the first prefilling request's last position.
    t = torch.arange(cap.tiles * Q, device=dev)
    treq = request_of(torch.minimum(t, T - 1), ends)
    real = t < T
    live = real & is_pre[treq]
    filler = torch.argmax(is_pre.int()).view(1)  # (a 1-element index: a 0-d one would be read on the host)
    position = torch.where(real, ctx[treq] + t - starts[treq], 0)
    page = tables[treq, position // P].long()

    # Spans: the key's decode rows, then its segments (a segment's index is shifted by the decode rows).
    n = torch.arange(cap.decode_rows + cap.segments, device=dev)
    dec_rows = decode_shape[0] * rows
    on_dec = n < dec_rows
    d, s = n.clamp(max=cap.decode_rows - 1), (n - dec_rows).clamp(0, cap.segments - 1)

    def spans(decode_part, segment_part):
        return torch.where(on_dec, decode_part[d], segment_part[s])

    return {
        "decode_req": row_req, "decode_src": decode_src, "decode_dst": torch.where(dvalid, starts[dreq], -1),
        "span_req": spans(row_req, sreq), "span_q_lo": spans(row_pos, seg_q_lo), "span_q_hi": spans(row_pos, seg_q_hi),
        "span_valid": spans(rvalid, sreal), "span_split": spans(r % rows, torch.zeros_like(k)),
        "span_kv0": spans(torch.zeros_like(r), torch.where(sreal, kv0_req[sreq], 0)),
        "seg_tile": seg_tile, "tile_single": tile_single,
        "prefill_req": torch.where(live, treq, filler), "prefill_pos": torch.where(live, position, sl[filler] - 1),
        "prefill_kv0": torch.where(live, kv0_req[treq], DEAD_KV0),
        "ws_req": torch.where(wreal, wreq, 0), "ws_page": ws_page,
        "positions": position, "slots": torch.where(real, page * P + position % P, scratch_slot),
    }


def key_views(plan: dict[str, torch.Tensor], num_decode: int, rows: int, num_tiles: int, num_segments: int,
              workspace_pages: int) -> dict[str, torch.Tensor]:
    """The leading entries of each array that a key of these sizes reads (views: no copy)."""
    dec, spans, tokens = num_decode * rows, num_decode * rows + num_segments, num_tiles * Q_TILE
    sizes = {"decode_req": dec, "decode_src": dec, "decode_dst": num_decode, "seg_tile": num_segments,
             "tile_single": num_tiles, "ws_req": workspace_pages, "ws_page": workspace_pages}
    sizes.update(dict.fromkeys(("span_req", "span_q_lo", "span_q_hi", "span_valid", "span_split", "span_kv0"), spans))
    sizes.update(dict.fromkeys(("prefill_req", "prefill_pos", "prefill_kv0", "positions", "slots"), tokens))
    return {name: plan[name][:n] for name, n in sizes.items()}
