"""CUDA graphs for pure decode steps: the whole step, metadata included, replayed from static buffers.

For each batch bucket (`policy.decode_buckets`: 1, 2, 4 ... 64, 96, 128, then multiples of 64) one graph holds:
page map → page lists → BlockMasks → embeddings → every layer (flex reading its BlockMask from the
static buffers) → logits. The host only copies ids, positions, slots, block tables and lengths into the
buffers and replays; padded rows have seq_len 0, so they read no page and write a scratch slot.
Everything baked into a graph (bucket size, split-KV count, pool size, table width, parameter names and
dtypes) is part of its key.
"""
from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..attention.metadata import LAYOUT_FIELDS, AttentionMetadata, build_metadata, build_phys_to_logical
from ..attention.layout import choose_decode_splits, plan_layout
from ..attention.staging import copy_into
from .policy import compile_count, compiled_on_first_use, decode_buckets, decode_regions


# Decode buckets up to this batch run their regions' combo-kernel version (compile.decode_regions): batch 1 is
# compiled on its own anyway (size 1 is specialised); a larger value adds compiles. Session 36 (H100) measured 32:
# batch 8 1.442 against 1.460 ms a step, batch 32 1.550-1.558 against 1.552-1.603, but 5 more dynamo graphs at start-up
# (a fresh start's batch-32 bucket 12.6 s against 2.0, a cached one's 3.0 against 0.5): not taken (issue 24).
COMBO_UP_TO = 1


@dataclass(frozen=True)
class GraphKey:
    batch: int
    splits: int
    num_blocks: int
    table_width: int
    params: tuple[tuple[str, torch.dtype], ...]


STILL, MOVE, FILL, GATHER = 0, 1, 2, 3  # what a decode graph's take_inputs does with its staged inputs (DecodeBuffers.inputs)


class DecodeBuffers:
    """Static inputs for the largest bucket; a bucket uses the leading rows."""

    def __init__(self, max_bs: int, width: int, params: dict[str, torch.dtype], scratch_slot: int, device):
        self.input_ids = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_bs,), scratch_slot, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(max_bs, width, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.params = {name: torch.zeros(max_bs, dtype=dtype, device=device) for name, dtype in params.items()}
        self.max_bs, self.scratch_slot = max_bs, scratch_slot
        # What the host sends a step, in one copy, read by the graph's first kernels (take_inputs): [mode, rows n,
        # new pages k, max_bs (row, column, page) triples, max_bs source rows | the packed batch, pack_decode's
        # [4 + width, max_bs]]. STILL: the buffers as they are; MOVE: rows 0..n-1 move one token on, fed fed_ids,
        # after the k new pages enter the tables; GATHER: the same, row i taken from row src[i] of the last batch
        # (rows that left are dropped, rows past n become inert padding); FILL: the packed batch replaces every row
        # (rows past n: inert padding).
        self.header = 3 + 4 * max_bs
        self.inputs = torch.zeros(self.header + (4 + width) * max_bs, dtype=torch.long, device=device)
        self.fed_ids = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.held: tuple[int, int, int] | None = None  # the (mode, n, k) `inputs` holds, when a move wrote it

    def stage(self, packed: np.ndarray, n: int, params) -> None:
        """Send a whole batch (pack_decode's array over max_bs columns, n real) for the next replay."""
        assert packed.shape[1] == self.max_bs and packed.shape[0] <= 4 + self.block_tables.shape[1], packed.shape
        header = np.zeros(self.header, dtype=np.int64)
        header[:2] = FILL, n
        copy_into(np.concatenate([header, packed.ravel()]), self.inputs, self.inputs.device)
        self.held = None
        for name, buf in self.params.items():
            assert params[name].dtype == buf.dtype, (name, params[name].dtype, buf.dtype)  # one kernel per dtype
            buf[:n].copy_(params[name])

    def staged_ids(self, n: int) -> torch.Tensor:
        """The staged batch's input ids (a view), for ids known only on the device (async scheduling)."""
        return self.inputs[self.header:self.header + n]

    def move_on_next(self, token_ids: torch.Tensor, new_pages: np.ndarray | None = None,
                     src: np.ndarray | None = None) -> None:
        """Make the next replay move rows 0..n-1 one token on, fed `token_ids` (the last step's samples, on the
        device), after writing `new_pages` ([3, k]: row, column and page of each page appended since). src: int64 [n],
        row i's row in the last batch (whose samples `token_ids` are, one per row), where rows left or moved."""
        n = token_ids.shape[0] if src is None else len(src)
        k = 0 if new_pages is None else new_pages.shape[1]
        assert k <= n and (k == 0 or new_pages[1].min() > 0), (k, n)  # one page a row at most, never a first one
        # (a steady batch with no new page sends nothing: the buffer holds its header)
        if src is not None or self.held != (MOVE, n, 0) or k:
            mode = MOVE if src is None else GATHER
            moves = np.empty(3 + 3 * k if src is None else 3 + 3 * self.max_bs + n, dtype=np.int64)
            moves[:3] = mode, n, k
            if k:
                moves[3:3 + 3 * k] = new_pages.T.ravel()
            if src is not None:
                moves[3 + 3 * self.max_bs:] = src
            copy_into(moves, self.inputs, self.inputs.device)
            self.held = (mode, n, k)
        self.fed_ids[:token_ids.shape[0]].copy_(token_ids)


def take_inputs(inputs, fed_ids, input_ids, positions, seq_lens, block_tables, slot_mapping, block_size: int,
                scratch_slot: int) -> None:
    """Inside the decode graph, before its metadata: the step's inputs from DecodeBuffers.inputs (its mode says how).
    input_ids, positions, slot_mapping: the bucket's rows (two at batch 1); seq_lens, block_tables: every row."""
    bs, max_bs, width = input_ids.shape[0], seq_lens.shape[0], block_tables.shape[1]
    header = 3 + 4 * max_bs
    mode, n = inputs[0], inputs[1]
    gather = mode == GATHER
    moving, filling = (mode == MOVE) | gather, mode == FILL
    # The bucket's rows are taken by index, never sliced [:bs]: a slice of the largest bucket (bs == max_bs, the first
    # one captured) guards on the sizes being equal, and every smaller bucket recompiled (TORCH_LOGS=recompiles on
    # the H100, session 29)
    rows, every = torch.arange(bs, device=inputs.device), torch.arange(max_bs, device=inputs.device)
    staged = inputs[header:].view(4 + width, max_bs)
    mine = staged.index_select(1, rows)  # the bucket's columns
    entry = inputs[3:3 + 3 * max_bs].view(max_bs, 3)
    # each row's row in the last batch: itself, but for GATHER (whose rows past the bucket are not in `positions`:
    # a live row's next position is its last length instead, as every mode keeps seq_lens at position + 1)
    src = torch.where(gather & (rows < n), inputs[3 + 3 * max_bs:header].index_select(0, rows), rows)
    last_lens = seq_lens.index_select(0, src)
    block_tables.index_copy_(0, rows, block_tables.index_select(0, src))
    new = moving & (every < inputs[2])
    # entries past k (an earlier step's) rewrite row 0's first page as it is: a new page is never a first one
    row, col = torch.where(new, entry[:, 0], 0), torch.where(new, entry[:, 1], 0)
    block_tables[row, col] = torch.where(new, entry[:, 2], block_tables[row, col].long()).int()
    tables = torch.where(filling, mine[4:].t().int(), block_tables.index_select(0, rows))
    block_tables.index_copy_(0, rows, tables)
    on = moving & (rows < n)  # (n <= bs)
    moved_lens = torch.zeros_like(seq_lens).index_copy(0, rows, last_lens + 1)
    kept = torch.where(gather, 0, seq_lens)  # rows past n: as they were, or inert padding after a GATHER
    seq_lens.copy_(torch.where(filling, staged[3].int(), torch.where(moving & (every < n), moved_lens, kept)))
    ids = torch.where(filling, mine[0], torch.where(on, fed_ids.index_select(0, src), input_ids))
    pos = torch.where(filling, mine[1], torch.where(on, torch.where(gather, last_lens.long(), positions + 1), positions))
    page = tables.gather(1, (pos // block_size)[:, None]).squeeze(1)
    slot = torch.where(on, page.long() * block_size + pos % block_size, slot_mapping)
    slot = torch.where(filling | gather, torch.where(rows < n, torch.where(filling, mine[2], slot), scratch_slot), slot)
    input_ids.copy_(ids)
    positions.copy_(pos)
    slot_mapping.copy_(slot)


def decode_layout(seq_lens: list[int], splits: int):
    """A decode bucket's layout: one query a row, and for a bucket of one row a padding span past it. Dynamo compiles
    a size of 1 on its own: with one span, the batch-1 graph's positions were a graph of their own, and its page lists
    one that the prompt-step graphs with one decode row beside their spans could not share (a graph more each on a
    fresh start, TORCH_LOGS=recompiles on an H200, session 48)."""
    return plan_layout([1] * len(seq_lens), seq_lens, decode_splits=splits, pad_segments_to=int(len(seq_lens) == 1))


def own_layout_tensors(meta: AttentionMetadata) -> AttentionMetadata:
    """`meta` with each layout array in a tensor of its own (a copy, once per bucket), as the mixed graphs' plan
    gives them. build_metadata's are views of one packed copy, at storage offsets that differ by bucket (1 at one
    decode row, more past it) and from the mixed graphs' (0); dynamo specialises offsets 0 and 1, and guards on
    them made 2 of the page lists' 6 graphs at start-up (TORCH_LOGS=recompiles on the H100, session 32's call 1)."""
    for name in LAYOUT_FIELDS:
        setattr(meta, name, getattr(meta, name).clone())
    return meta


def take_decode_inputs(inputs, fed_ids, input_ids, positions, slot_mapping, block_size: int, scratch_slot: int,
                       meta: AttentionMetadata) -> None:
    """take_inputs into the buffers `meta` views, then the page map and query positions from what it wrote: one
    compiled graph on CUDA where the two as helpers of their own were two (the same kernels, so the same compile
    seconds at a fresh start: session 52)."""
    take_inputs(inputs, fed_ids, input_ids, positions, meta.seq_lens, meta.block_tables, slot_mapping, block_size,
                scratch_slot)
    refresh_decode_positions(meta)


def kept_page_lists(mods, rows: dict[str, int], num_blocks: int, device) -> dict:
    """Per mask of `mods`, zeroed pool-wide page-list tables [rows, num_blocks] int32 by name, each with its full
    list's (name + "_full"): paged_mods.build_block_masks' `out`, which a graph's lists are written into. Made
    before any capture (in a capture they would be the graph's own memory, zeroed at each replay). A row more: the
    decode lists list one more than they are read (paged_mods.decode_lists)."""
    with torch.inference_mode():  # (as the ordinary step's tensors: a dispatch-key difference is a recompile)
        return {mask_mod: {name + full: torch.zeros(n + 1, num_blocks, dtype=torch.int32, device=device)
                           for name, n in rows.items() for full in ("", "_full")}
                for mask_mod in dict.fromkeys(m for m, _ in mods)}


def refresh_decode_positions(meta: AttentionMetadata) -> None:
    """The page map and each decode row's query position, from the lengths and tables in the buffers."""
    meta.phys_to_logical.copy_(build_phys_to_logical(meta.block_tables, meta.seq_lens, meta.block_size,
                                                     meta.num_blocks))
    q_pos = meta.seq_lens.long()[meta.span_req] - 1
    meta.span_q_lo.copy_(q_pos)
    meta.span_q_hi.copy_(q_pos)


# On CUDA: a few kernels inside the decode graphs, not a launch per op.
_compiled_take_decode_inputs = compiled_on_first_use(take_decode_inputs)


@contextlib.contextmanager
def graph_capture(graph: torch.cuda.CUDAGraph, pool) -> None:
    """torch.cuda.graph with the garbage collector paused. A collection inside a capture can free an
    engine the user dropped (a lazy import's traceback cycle can hold one), and destroying its CUDA graphs
    is an operation CUDA refuses while a stream captures: the capture is lost (found on the H100)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            yield
    finally:
        if enabled:
            gc.enable()


class DecodeGraphRunner:
    """Captures and replays decode steps of `run_model(input_ids, positions, meta) -> logits`."""

    def __init__(self, forward_logits, backend, mods, *, max_num_seqs: int, block_size: int, num_blocks: int,
                 table_width: int, num_kv_heads: int, params: dict[str, torch.dtype], scratch_slot: int, device,
                 use_graphs: bool = True):
        self.forward_logits, self.backend, self.mods = forward_logits, backend, mods
        self.block_size, self.num_blocks, self.width, self.params = block_size, num_blocks, table_width, params
        self.device = torch.device(device)
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self.buckets = decode_buckets(max_num_seqs)
        self.splits = {b: choose_decode_splits(b, num_kv_heads, self.device) for b in self.buckets}
        with torch.inference_mode():  # as the ordinary step's tensors: a dispatch-key difference is a recompile
            self.bufs = DecodeBuffers(max(self.buckets), table_width, params, scratch_slot, self.device)
        self.metas: dict[int, AttentionMetadata] = {}
        self.keys: dict[int, GraphKey] = {}
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.logits: dict[GraphKey, torch.Tensor] = {}
        self.pool = None
        # Per mask, the pool-wide page-list tables every bucket's graph writes the leading rows and columns of (made
        # at the first step, before any capture): zeros past the table width, which no step writes again
        self.kept_lists: dict | None = None
        self.graph_bytes = 0
        self.capture_seconds = 0.0
        # each bucket's compile + capture seconds and the graphs dynamo compiled for it (start-up's breakdown)
        self.bucket_seconds: dict[int, tuple[float, int]] = {}

    def key(self, bs: int) -> GraphKey:
        if bs not in self.keys:  # (made once: a replay's host time is counted in µs)
            self.keys[bs] = GraphKey(bs, self.splits[bs], self.num_blocks, self.width, tuple(self.params.items()))
        return self.keys[bs]

    def bucket_for(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def static_meta(self, bs: int) -> AttentionMetadata:
        """The bucket's metadata over views of the static buffers (layout fixed: one query per row)."""
        if bs not in self.metas:
            b = self.bufs
            layout = decode_layout([1] * bs, self.splits[bs])
            # Whole per-request buffers (max_num_seqs rows), as the ordinary step pads them: one
            # compiled kernel per bucket serves both the graphs and mixed steps.
            meta = own_layout_tensors(build_metadata(b.block_tables, b.seq_lens, b.slot_mapping[:bs], layout,
                                                     self.block_size, self.num_blocks, dict(b.params)))
            meta.backend = self.backend
            self.metas[bs] = meta
        return self.metas[bs]

    def step(self, bs: int) -> torch.Tensor:
        meta = self.static_meta(bs)
        b = self.bufs
        if self.kept_lists is None:  # at the largest bucket's rows
            rows = max(n * splits for n, splits in self.splits.items())
            self.kept_lists = kept_page_lists(self.mods, {"decode": rows}, self.num_blocks, self.device)
        # the inputs of two rows at batch 1: the second is padding, as a bucket's rows past n are (DecodeBuffers), and
        # dynamo compiles no graph of its own for one row (session 48)
        taken = min(max(bs, 2), b.max_bs)
        with decode_regions(bs <= COMBO_UP_TO):  # small batches: the buckets whose steps are launch-bound
            (_compiled_take_decode_inputs() if b.inputs.is_cuda else take_decode_inputs)(
                b.inputs, b.fed_ids, b.input_ids[:taken], b.positions[:taken], b.slot_mapping[:taken],
                self.block_size, b.scratch_slot, meta)
            # the page lists, from the lengths and tables just taken (on CUDA through Inductor too)
            meta.backend_state = {"kept_lists": self.kept_lists}
            self.backend.prepare(meta, self.mods)
            return self.forward_logits(b.input_ids[:bs], b.positions[:bs], meta)

    @torch.inference_mode()
    def capture_all(self, progress=list) -> None:
        """Compile every bucket, then (on CUDA) capture it, largest first, into one shared memory pool.
        progress(buckets) → the buckets, as it shows them (compile.warmup.progress)."""
        start = time.perf_counter()
        if not self.use_graphs:
            for bs in progress(self.buckets):
                self.step(bs)
            self.capture_seconds = time.perf_counter() - start
            return
        gc.collect()  # what dropped engines hold goes now, not inside a capture
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self.pool = torch.cuda.graph_pool_handle()
        for bs in progress(sorted(self.buckets, reverse=True)):
            started, compiled = time.perf_counter(), compile_count()
            self.step(bs)  # compile and autotune outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with graph_capture(graph, self.pool):
                self.logits[self.key(bs)] = self.step(bs)
            self.graphs[self.key(bs)] = graph
            self.bucket_seconds[bs] = (round(time.perf_counter() - started, 1), compile_count() - compiled)
        torch.cuda.synchronize(self.device)
        self.graph_bytes = torch.cuda.memory_allocated(self.device) - before
        self.capture_seconds = time.perf_counter() - start

    @torch.inference_mode()
    def run(self, packed: np.ndarray, n: int, params: dict[str, torch.Tensor], feed=None) -> torch.Tensor:
        """Logits [n, V] for a pure decode step of n <= max bucket rows, packed by pack_decode over the buffers'
        max_bs columns; feed(input_ids) writes ids known only on the device into the staged batch."""
        assert self.bucket_for(n) is not None and packed.shape[0] - 4 <= self.width, (n, packed.shape)
        self.bufs.stage(packed, n, params)
        if feed is not None:
            feed(self.bufs.staged_ids(n))
        return self.replay(n)

    @torch.inference_mode()
    def run_moved_on(self, token_ids: torch.Tensor, new_pages: np.ndarray, src: np.ndarray | None = None) \
            -> torch.Tensor:
        """Logits of a decode step whose batch is the last run's, each row one token on: the graph moves its
        buffers on itself, given the tokens and the pages appended since (new_pages [3, k]: row, column, page).
        src: each row's row in the last batch, where rows left or moved (token_ids then are the last batch's rows)."""
        self.bufs.move_on_next(token_ids, new_pages, src)
        return self.replay(token_ids.shape[0] if src is None else len(src))

    @torch.inference_mode()
    def run_next(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Logits of the step after the last one run, whose sampled tokens are `token_ids` [n]: the
        buffers advance on the device, so nothing waits for the host."""
        self.bufs.move_on_next(token_ids)
        return self.replay(token_ids.shape[0])

    def replay(self, n: int) -> torch.Tensor:
        bs = self.bucket_for(n)
        key = self.key(bs)
        if key in self.graphs:
            self.graphs[key].replay()
            return self.logits[key][:n]
        return self.step(bs)[:n]  # CPU (or graphs off): the same static-buffer path, run eagerly
