"""The user's logical mods on the paged pool, and the BlockMasks of a step.

A mod is written over logical coordinates (request, head, query position, key position); flex runs it over
physical ones (a row of the step's token buffer or decode rows, a slot of the pool or the workspace). `paged_mask`
and `paged_score` translate back, evaluating the user's mod only where the position is live; `build_block_masks`
lists each q block's pages (metadata.py) as one BlockMask for the decode rows and one for the prefill tiles.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

from ...compile import compiled_on_first_use
from ...masks import MASK_ARGS, SCORE_ARGS, mod_name, request_params
from ..metadata import AttentionMetadata, decode_full_lists, page_lists, tile_page_lists, workspace_lists
from ..layout import DEAD_KV0, KV_TILE, Q_TILE
from .flex_kernels import call_tiles


def param_values(meta: AttentionMetadata, fn, base_args) -> list[torch.Tensor]:
    values = []
    for name in request_params(fn, base_args):
        if name not in meta.params:
            raise ValueError(f"{mod_name(fn)} reads the per-request parameter {name!r}, which the step's "
                             f"requests did not supply (attention_params={{{name!r}: ...}})")
        values.append(meta.params[name])
    return values


def _live_coords(meta: AttentionMetadata, decode: bool, req, q_pos, lkv):
    """The request and positions the user's mod sees (docs/attention.md): a request with tokens, positions
    in [0, seq_len). Flex also evaluates the mod on slots that are not tokens of the request (other
    requests' pages or workspace blocks, the tail of its last page, padding); the caller masks those
    afterwards, but a mod indexing a captured tensor must never see them (an out-of-bounds read in a
    compiled kernel). Prefill rows arrive valid (plan_layout gives dead rows a real request and
    position), so they pay two clamps per element; a padded decode row of a CUDA graph (length 0)
    reads as request 0."""
    if decode:
        req = torch.where(meta.seq_lens[req] > 0, req, 0)
        last = (meta.seq_lens[req] - 1).clamp(min=0)  # 0 only while a graph is captured over empty buffers
        return req, last, torch.minimum(lkv, last)
    last = meta.seq_lens[req] - 1
    lkv = torch.where(lkv < last, lkv, last)  # where, not min/max: FA4's CuTe code generator expresses it
    return req, q_pos, torch.where(lkv > 0, lkv, 0)


def _logical_kv(meta: AttentionMetadata, req, kv_idx, listed_only: bool):
    """Physical pool index → (logical kv position, whether it is a live token of request `req`).

    A kernel that visits only the listed pages (compiled flex on CUDA) sees pages of `req` alone, since
    the lists come from its block table. Elsewhere (eager flex scores the whole compacted pool) ownership
    is checked too: a [q, kv] gather from the block tables, which in the Triton kernel's partial tiles
    cost more than the attention itself (docs/benchmarks.md, session 7).
    """
    P = meta.block_size
    page = kv_idx // P
    lp = meta.phys_to_logical[page]
    lkv = lp * P + kv_idx % P
    live = lkv < meta.seq_lens[req]
    if not listed_only:
        live = live & (meta.block_tables[req, lp] == page)
    return lkv, live


def _query(meta: AttentionMetadata, decode: bool, b, q_idx):
    """The request and logical query position of a flex (batch row, query row); a decode row's position
    is its request's last, which _live_coords sets once it has made the request a live one."""
    if decode:
        return meta.decode_req[b], None
    return meta.prefill_req[q_idx], meta.prefill_pos[q_idx]


def paged_mask(meta: AttentionMetadata, mask_mod, decode: bool, listed_only: bool = False, workspace: bool = False,
               direct: bool = False, group: int = 0):
    """The user's logical mask on the pool's physical coordinates (or, for prefill rows with
    `workspace`, the workspace's); `listed_only`: the kernel visits only the blocks in the BlockMask's
    lists (compiled flex on CUDA); `direct`: prefill rows of the compiled kernel reading the pool's pages in
    place (tile_page_lists), int32 throughout; `group`: decode rows whose query rows are the `group` query heads
    of a KV head (heads_as_rows_block_mask)."""
    values = param_values(meta, mask_mod, MASK_ARGS)
    assert not (decode and (workspace or direct)) and (decode or not group)

    rows = _prefill_rows(meta) if workspace or direct else None
    P, width = meta.block_size, meta.block_tables.shape[1]
    tables = meta.block_tables.reshape(-1) if direct else None  # (flat: one index, as FA4's code generator takes)
    limit = _prefill_limits(meta) if direct else None

    def mask(b, h, q_idx, kv_idx):
        if group:  # flex's head h is a KV head, its query row q_idx the query head within h's group
            h = h * group + q_idx
        if workspace:  # a block of another request, or any block for a dead row (kv0 = DEAD_KV0): lkv out of range
            req, q_pos, kv0 = rows[0][q_idx], rows[1][q_idx], rows[2][q_idx]
            lkv = kv_idx - kv0
            live = (lkv >= 0) & (lkv < meta.seq_lens[req])
        elif direct:  # a tile of several requests lists the pages of each: the row's request must own the page
            req, q_pos, row_limit = rows[0][q_idx], rows[1][q_idx], limit[q_idx]
            page = kv_idx // P
            lp = meta.phys_to_logical[page]
            lkv = lp * P + kv_idx % P
            live = (lkv < row_limit) & (tables[req * width + lp] == page)
            last = row_limit - 1  # (_live_coords' clamp from the row's own limit: one gather fewer per element)
            lkv = torch.where(lkv < last, lkv, last)
            return live & mask_mod(req, h, q_pos, torch.where(lkv > 0, lkv, 0), *values)
        else:
            req, q_pos = _query(meta, decode, b, q_idx)
            lkv, live = _logical_kv(meta, req, kv_idx, listed_only)
            if not decode:  # decode tokens and padding are dead rows of the prefill call
                live = live & (meta.prefill_kv0[q_idx] < DEAD_KV0)
        req, q_pos, lkv = _live_coords(meta, decode, req, q_pos, lkv)
        return live & mask_mod(req, h, q_pos, lkv, *values)
    return mask


def _prefill_rows(meta: AttentionMetadata):
    """Each prefill row's request, position and workspace start, as int32: the index arithmetic of the
    mods then stays in 32 bits, as FlashAttention-4's CuTe code generator requires (it refused int64).
    Made once per step, for every mask and score mod."""
    if "prefill_rows" not in meta.backend_state:
        # dead rows up to a whole q block: a kernel tile divides the block, and FA4's 192-row tiles in a wide step's
        # 384-row blocks evaluate the mods on rows past the call's last (an out-of-bounds read of these tables, and
        # an illegal address in the engine, without them); they take the last row's request and position, which
        # the mods may read (a dead row's are a live token's)
        lay, n = meta.layout, len(meta.prefill_req)
        pad, tiles = -n % (lay.q_tiles * Q_TILE), call_tiles(meta)
        if tiles > lay.num_tiles:  # a one-tile step's call of two, its second tile empty
            pad = tiles * Q_TILE - n
        more = lambda t: torch.cat([t, t[-1:].expand(pad)]).int() if pad else t.int()  # noqa: E731
        meta.backend_state["prefill_rows"] = (more(meta.prefill_req), more(meta.prefill_pos),
                                              F.pad(meta.prefill_kv0.int(), (0, pad), value=DEAD_KV0))
    return meta.backend_state["prefill_rows"]


def _prefill_limits(meta: AttentionMetadata) -> torch.Tensor:
    """Per prefill row, int32: its request's length, or 0 for a dead row (no key is live for it). The direct mask's
    one gather for both (the workspace's kv0 test and the length), made once per step."""
    if "prefill_limits" not in meta.backend_state:
        req, _, kv0 = _prefill_rows(meta)
        meta.backend_state["prefill_limits"] = torch.where(kv0 < DEAD_KV0, meta.seq_lens.int()[req], 0)
    return meta.backend_state["prefill_limits"]


class _IndexRead(Exception):
    """A coordinate reached an op in reads_coordinates' probe."""


class _RefusedIndex(torch.Tensor):
    """An index that refuses every use."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise _IndexRead(func)


@functools.cache
def reads_coordinates(score_mod) -> bool:
    """Whether `score_mod` reads its request, head, query or key index (or a per-request parameter, which it reads
    by the request). A mod of the score alone (softcap, a temperature) needs none of paged_score's mapping back to
    logical coordinates, whose gathers from the step's tensors would otherwise come along into the kernel as its
    captured inputs. Probed once, by calling the mod on a score with indices that refuse every use: anything that
    fails counts as reading."""
    if request_params(score_mod, SCORE_ARGS):
        return True
    index = torch.zeros((), dtype=torch.int32).as_subclass(_RefusedIndex)
    try:
        score_mod(torch.zeros(()), index, index, index, index)
    except Exception:  # (_IndexRead, or whatever else a mod does with an index it cannot use)
        return True
    return False


def paged_score(meta: AttentionMetadata, score_mod, decode: bool, workspace: bool = False, direct: bool = False,
                group: int = 0):
    """The user's logical score mod on the physical coordinates, as paged_mask's mask."""
    if score_mod is None:
        return None
    if not reads_coordinates(score_mod):
        return score_mod  # the same on every coordinate system
    values = param_values(meta, score_mod, SCORE_ARGS)
    P = meta.block_size
    assert decode or not group

    rows = _prefill_rows(meta) if workspace or direct else None

    def score(s, b, h, q_idx, kv_idx):
        if group:  # (paged_mask's)
            h = h * group + q_idx
        if workspace:
            req, q_pos, lkv = rows[0][q_idx], rows[1][q_idx], kv_idx - rows[2][q_idx]
        else:  # the pool's coordinates (direct: the prefill rows as int32)
            req, q_pos = (rows[0][q_idx], rows[1][q_idx]) if direct else _query(meta, decode, b, q_idx)
            lkv = meta.phys_to_logical[kv_idx // P] * P + kv_idx % P
        req, q_pos, lkv = _live_coords(meta, decode, req, q_pos, lkv)
        return score_mod(s, req, h, q_pos, lkv, *values)
    return score


def _pool_wide(idx_NM: torch.Tensor, num_blocks: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, M] page lists → a dense [N, num_blocks] table (zeros past column M); in the leading rows of `out`
    [>= N, num_blocks] when given.

    Flex requires the BlockMask to span the whole KV length (the pool), though a row is only read up
    to its count (<= M). An overlapping strided view would keep this O(batch): compiled flex on the
    H100 read every row but the first wrongly from one (docs/benchmarks.md), so the table is dense.
    """
    N, M = idx_NM.shape
    out = idx_NM.new_zeros(N, num_blocks) if out is None else out[:N].zero_()
    out[:, : min(M, num_blocks)] = idx_NM[:, :num_blocks]
    return out


def build_block_masks(meta: AttentionMetadata, mask_mod, listed_only: bool, workspace_pages: int,
                      direct: bool = False, q_tiles: int = 1, out: dict | None = None):
    """(decode BlockMask or None, prefill BlockMask or None) for one logical mask. Decode rows read
    the pool's pages; prefill tiles read KV_TILE blocks of a workspace of `workspace_pages` pages, or with
    `direct` (pages of KV_TILE tokens) the pool's pages in place, at most `workspace_pages` a q block of
    `q_tiles` tiles. `out`: tables [rows, num_blocks] that outlive the step, by name ("decode", "decode_full",
    "prefill", "prefill_full"), which the decode lists are written into (decode_lists) and the prefill lists copied
    into (a pool-wide list per graph was ~16-64 MB: compile/mixed_graphs.py's plan graphs and compile/cuda_graphs.py's
    decode graphs share a set)."""
    lay, P = meta.layout, meta.block_size
    values = param_values(meta, mask_mod, MASK_ARGS)
    Bd, Tp = lay.num_decode * lay.decode_splits, lay.num_tiles
    empty = call_tiles(meta) - Tp  # (FlexBackend.plan_prefill_call: a one-tile step's symbolic call takes two)
    dec = pre = None
    if Bd:
        M = meta.num_blocks
        kv_idx, full_idx = (out["decode"], out["decode_full"]) if out is not None else (
            meta.block_tables.new_zeros(Bd + 1, M), meta.block_tables.new_zeros(Bd + 1, M))
        lists = _compiled_decode_lists() if listed_only else decode_lists  # (listed_only: compiled, on CUDA)
        kv_num, full_num = lists(meta, mask_mod, values, kv_idx, full_idx)
        kv_num, full_num = kv_num[:Bd], full_num[:Bd]  # (decode_lists lists a row more)
        # no full lists where page_lists made every page partial (kernel splits: flex's decode template splits a
        # full list by the pool's length, not the row's list)
        full = (None, None) if not decode_full_lists(meta) else (
            full_num.view(Bd, 1, 1), full_idx[:Bd].view(Bd, 1, 1, M))
        dec = BlockMask.from_kv_blocks(
            kv_num.view(Bd, 1, 1), kv_idx[:Bd].view(Bd, 1, 1, M), *full,
            BLOCK_SIZE=(Q_TILE, P), mask_mod=paged_mask(meta, mask_mod, True, listed_only),
            seq_lengths=(1, M * P), compute_q_blocks=False)
    if Tp and direct:
        M = meta.num_blocks
        kv_num, kv_idx, full_num, full_idx = with_empty_tiles(
            empty, *tile_page_lists(meta, mask_mod, values, workspace_pages, q_tiles))
        Tb = kv_num.shape[0]  # q blocks: the last may hold fewer than q_tiles tiles
        pre = BlockMask.from_kv_blocks(
            kv_num.view(1, 1, Tb), _pool_wide(kv_idx, M, out and out["prefill"]).view(1, 1, Tb, M),
            full_num.view(1, 1, Tb), _pool_wide(full_idx, M, out and out["prefill_full"]).view(1, 1, Tb, M),
            BLOCK_SIZE=(q_tiles * Q_TILE, P),
            mask_mod=paged_mask(meta, mask_mod, False, direct=True), seq_lengths=((Tp + empty) * Q_TILE, M * P),
            compute_q_blocks=False)
    elif Tp:
        kv_len = workspace_pages * P
        assert kv_len % KV_TILE == 0, (workspace_pages, P)
        M = kv_len // KV_TILE
        Tc = Tp + empty
        kv_num, kv_idx, full_num, full_idx = with_empty_tiles(empty, *workspace_lists(meta, mask_mod, values, M))
        pre = BlockMask.from_kv_blocks(
            kv_num.view(1, 1, Tc), kv_idx.view(1, 1, Tc, M), full_num.view(1, 1, Tc), full_idx.view(1, 1, Tc, M),
            BLOCK_SIZE=(Q_TILE, KV_TILE), mask_mod=paged_mask(meta, mask_mod, False, listed_only, workspace=True),
            seq_lengths=(Tc * Q_TILE, kv_len), compute_q_blocks=False)
    return dec, pre


def with_empty_tiles(more: int, kv_num, kv_idx, full_num, full_idx):
    """The prefill lists ([Tb], [Tb, M] each) with `more` empty q tiles after them (flex_kernels.call_tiles): no
    page listed, so the kernel computes nothing there."""
    if not more:
        return kv_num, kv_idx, full_num, full_idx
    return F.pad(kv_num, (0, more)), F.pad(kv_idx, (0, 0, 0, more)), F.pad(full_num, (0, more)), \
        F.pad(full_idx, (0, 0, 0, more))


def heads_as_rows_block_mask(meta: AttentionMetadata, dec: BlockMask, mask_mod, group: int,
                             listed_only: bool) -> BlockMask:
    """The decode BlockMask `dec` of `mask_mod` for flex's attention template over decode rows [T, Hkv, group, D]:
    each KV head's `group` query heads as its query rows, under the same page lists (one q block)."""
    return BlockMask.from_kv_blocks(
        dec.kv_num_blocks, dec.kv_indices, dec.full_kv_num_blocks, dec.full_kv_indices, BLOCK_SIZE=dec.BLOCK_SIZE,
        mask_mod=paged_mask(meta, mask_mod, True, listed_only, group=group), seq_lengths=(group, dec.seq_lengths[1]),
        compute_q_blocks=False)


def decode_lists(meta: AttentionMetadata, mask_mod, values: list[torch.Tensor], kv_idx_out: torch.Tensor,
                 full_idx_out: torch.Tensor):
    """The decode rows' page lists (page_lists) written into the leading rows and columns of pool-wide tables
    [>= rows, num_blocks], zeros elsewhere: → (partial counts, full counts). Flex wants the BlockMask as wide as the
    pool, but reads a row only up to its count (<= the table width M), so the columns past M stay the zeros they
    were made with, and a step writes [rows, M] instead of widening to [rows, pool] (two pool-wide tables were
    2 x 4 MB a batch-32 step over a 31,289-page pool, 2 x 32 MB at 256 rows: session 43). A step without full lists
    (decode_full_lists) writes its empty ones all the same (no branch for dynamo to guard: a graph each side), and
    its BlockMask does not read them.
    One row more than the step's decode rows (page_lists' extra_row), which the caller drops: dynamo specialises a
    size of 1, and one decode row's lists were a graph of their own, ~2.5-4 s of a fresh start (sessions 49-50)."""
    kv_num, kv_idx, full_num, full_idx = page_lists(meta, mask_mod, values, extra_row=True)
    (N, M), num_blocks = kv_idx.shape, kv_idx_out.shape[1]
    kv_idx_out[:N, : min(M, num_blocks)] = kv_idx[:, :num_blocks]
    full_idx_out[:N, : min(M, num_blocks)] = full_idx[:, :num_blocks]
    return kv_num, full_num


# One Inductor graph for the ~40 small integer ops of the lists, which a decode CUDA graph otherwise replays as as
# many kernels every step (at batch 1 each costs its run plus ~1 µs of launch gap: docs/benchmarks.md, session 18).
# Dynamic shapes: the buckets share it.
_compiled_decode_lists = compiled_on_first_use(decode_lists)
