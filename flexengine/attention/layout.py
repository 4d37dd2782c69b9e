"""Where each query of a step sits in the flex calls: planned on the host from `query_lens` / `seq_lens`,
which the scheduler knows (attention/metadata.py turns a plan into device tensors; its docstring gives the
layout's reasons)."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from ..config import env_decode_splits, env_split_kv

Q_TILE = 128  # flex q block of the prefill call
KV_TILE = 128  # flex kv block of the prefill call, over the workspace
DEAD_KV0 = 1 << 30  # workspace start of a row that is not a prefill query: every key lies before it


def workspace_align(block_size: int) -> int:
    """Tokens a request's workspace span is rounded up to: whole pages and whole KV tiles."""
    return math.lcm(block_size, KV_TILE)


def workspace_tokens(query_lens, seq_lens, block_size: int) -> int:
    """Workspace tokens a step needs: each prefilling request's context, rounded up to the alignment."""
    a = workspace_align(block_size)
    sl = np.asarray(seq_lens, dtype=np.int64)[np.asarray(query_lens) > 1]
    return int((-(-sl // a) * a).sum())


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
    # Split-KV inside the decode kernel (flex's SPLIT_KV programs over each of its rows; decode_splits is then 1)
    kernel_splits: int = 1
    q_tiles: int = 1  # prefill tiles per q block of the in-place prefill call (the model runner's wide_q_tiles)

    @property
    def decode_req(self) -> np.ndarray:
        """Request of each decode row: its own array, so the decode kernel's inputs never change shape
        with the number of prefill segments."""
        return self.span_req[: self.num_decode * self.decode_splits]

    @property
    def decode_in_place(self) -> bool:
        """Every token is a decode row of its own request, in order, unsplit and unpadded: the decode kernel can read
        the queries and write the outputs where they are, with no gather before it and no scatter after."""
        return self.num_tiles == 0 and self.decode_splits == 1 and self.num_decode == self.num_tokens

    @property
    def token_capacity(self) -> int:
        """Rows of the token buffer: whole prefill tiles when there are any."""
        return max(self.num_tokens, self.num_tiles * Q_TILE)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


DECODE_PROGRAMS_PER_SM = 2  # (split, kv-head) programs a decode step aims for per SM (scripts/decode_step_probe.py)


def choose_decode_splits(num_decode: int, num_kv_heads: int, device) -> int:
    """Enough splits of each decode request's pages to give every SM about DECODE_PROGRAMS_PER_SM (split, kv-head)
    programs; 1 at large batch. plan_layout makes them rows of the flex call or the kernel's own programs
    (FLEXENGINE_SPLIT_KV).

    Always 1 off CUDA: merging splits needs the kernel's log-sum-exp, which CPU Inductor lacks.
    FLEXENGINE_DECODE_SPLITS caps it (every rank of tensor parallelism reads the same environment).
    """
    device = torch.device(device)
    if device.type != "cuda" or num_decode == 0:
        return 1
    programs = DECODE_PROGRAMS_PER_SM * _num_sms(device)
    return max(1, min(env_decode_splits() or 32, programs // (num_decode * num_kv_heads)))


def split_rows_or_programs(decode_splits: int, num_decode: int) -> tuple[int, int]:
    """(flex rows per decode request, the kernel's own split-KV programs per row) for `decode_splits` splits of
    `num_decode` (padded) decode requests: FLEXENGINE_SPLIT_KV's choice (auto: the kernel's programs for a lone
    request, rows otherwise)."""
    mode = env_split_kv() if decode_splits > 1 else "rows"
    if mode == "kernel" or (mode == "auto" and num_decode == 1):  # the same split, made by the kernel's programs
        return 1, decode_splits
    return decode_splits, 1


def plan_layout(query_lens: list[int], seq_lens: list[int], pad_decode_to: int = 0,
                pad_tiles_to: int = 0, decode_splits: int = 1, block_size: int | None = None,
                pad_workspace_to: int = 0, pad_segments_to: int = 0, q_tiles: int = 1) -> StepLayout:
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
    S, kernel_splits = split_rows_or_programs(decode_splits, Bd)
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
        decode_src=decode_src, decode_dst=decode_dst, ws_req=ws_req, ws_page=ws_page, kernel_splits=kernel_splits,
        q_tiles=q_tiles,
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
