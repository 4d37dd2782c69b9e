"""CUDA graphs for steps that carry prompt tokens: a prompt arriving at a busy server, a chunk of one.

Without a graph such a step launches every kernel of the model from Python: about 800 launches, 25 ms
of host time for 6 ms of GPU work when one 256-token prompt joins 32 decoding requests on the H100
(docs/benchmarks.md). Every decoding request waits for that step, so it set the server's TPOT.

A graph's shapes are fixed by the step's layout buckets (decode rows, their split-KV count, prefill
tiles and segments): the tokens are padded to `num_tiles * Q_TILE`, padded tokens write their K/V to the
scratch slot. The host sends only each request's query and sequence lengths, the ids and the block tables;
the layout, positions and slots (attention/device_plan.py), the page lists and the BlockMasks are built on
the device inside the graph, as in the decode graphs.
The engine captures every key at start-up (compile/warmup.capture_mixed_graphs); a key met later
anyway is captured then (that step runs the same code eagerly and uses its result).

Steps with more than `max_tiles` prefill tiles (up to the largest bucket, `plan_tiles`) run their model without a
graph (its launches are spread over thousands of tokens, and a whole graph per key would cost start-up seconds and
memory), but their plan and metadata come from a small graph of their own (`plan_graphs`): built by eager launches,
the metadata of an 8,192-token step cost 3.4-4.3 ms of host time on the H100 and H200 boxes, its graph's replay 35 µs
(sessions 33-34).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..attention.device_plan import PlanCapacity, align_pages, key_views, plan_on_device
from ..attention.metadata import LAYOUT_FIELDS, metadata_on_device
from ..attention.layout import KV_TILE, Q_TILE, StepLayout, choose_decode_splits, segment_capacity
from ..attention.staging import copy_into
from .cuda_graphs import graph_capture, kept_page_lists
from .policy import compiled_on_first_use, decode_buckets

logger = logging.getLogger(__name__)

# Prefill tiles the largest mixed graph holds: 2,048 prompt tokens, a full step at the default token
# budget (the scheduler cuts chunks on whole tiles, so such a step has at most 16).
MAX_GRAPH_TILES = 16
# Workspace KV tiles per prefill tile a mixed graph gathers at most: a chunk over a cached prefix up to
# 7x its length still replays a graph. Pages a step does not need are skipped by the copy kernel
# (attention/workspace.py), so the graph's size costs nothing, and its key needs no workspace size.
WORKSPACE_PER_TILE = 8


def graph_workspace_pages(num_tiles: int, block_size: int, capacity_pages: int | None) -> int:
    """Workspace pages a mixed graph of `num_tiles` prefill tiles gathers (its static size); none for a
    backend without a workspace (eager flex on the CPU reads the pages)."""
    if capacity_pages is None:
        return 0
    return min(WORKSPACE_PER_TILE * num_tiles * KV_TILE // block_size, capacity_pages)


@dataclass(frozen=True)
class MixedKey:
    num_decode: int  # decode requests, padded to a decode bucket
    splits: int      # split-KV rows per decode request
    num_tiles: int   # prefill tiles, padded to a bucket
    num_segments: int  # prefill segments, padded to layout.segment_capacity
    workspace_pages: int  # pages gathered into the prefill workspace (graph_workspace_pages of num_tiles)
    kernel_splits: int = 1  # the decode kernel's programs per row
    q_tiles: int = 1  # prefill tiles per q block (wide blocks: only past max_tiles, where the model runs eagerly)

    @classmethod
    def of(cls, layout: StepLayout) -> "MixedKey":
        return cls(layout.num_decode, layout.decode_splits, layout.num_tiles, layout.num_segments, len(layout.ws_req),
                   layout.kernel_splits, layout.q_tiles)

    @property
    def num_tokens(self) -> int:
        """Token capacity: whole tiles, decode tokens included."""
        return self.num_tiles * Q_TILE

    def layout(self) -> StepLayout:
        """The key's counts, which are all the backend reads of a layout (the arrays are the device plan's)."""
        empty = np.zeros(0, np.int64)
        return StepLayout(query_lens=[], seq_lens=[], num_tokens=self.num_tokens, num_decode=self.num_decode,
                          decode_splits=self.splits, num_tiles=self.num_tiles, num_segments=self.num_segments,
                          kernel_splits=self.kernel_splits, q_tiles=self.q_tiles,
                          **dict.fromkeys(LAYOUT_ARRAYS, empty))


LAYOUT_ARRAYS = [f for f in LAYOUT_FIELDS if f != "decode_req"]  # (decode_req: a view of span_req on the host)


class MixedGraphRunner:
    """Runs `run_model(input_ids, positions, meta) -> hidden` for steps with prompt tokens from graphs.

    A step's static inputs are its requests' query and sequence lengths and its ids (one packed buffer, shared by
    every key) and the block tables; the layout, positions and slots are planned inside the graph
    (attention/device_plan.py), at `capacity` sizes, so one compiled plan serves every key. A key of up to
    `max_tiles` prefill tiles replays one graph of the whole step; a larger one (up to `plan_tiles`) replays the
    graph of its plan and metadata, then runs the model eagerly on them."""

    def __init__(self, run_model, backend, mods, *, rows: int, table_width: int, block_size: int, num_blocks: int,
                 params: dict[str, torch.dtype], scratch_slot: int, device, num_kv_heads: int,
                 workspace_pages: int | None = None, pool=None, max_tiles: int = MAX_GRAPH_TILES,
                 plan_tiles: int | None = None, use_graphs: bool = True):
        self.run_model, self.backend, self.mods = run_model, backend, mods
        self.rows, self.width, self.block_size, self.num_blocks = rows, table_width, block_size, num_blocks
        self.scratch_slot, self.max_tiles, self.workspace_pages = scratch_slot, max_tiles, workspace_pages
        self.plan_tiles = max(max_tiles, plan_tiles or 0)
        self.device = torch.device(device)
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self.pool = pool
        buckets = decode_buckets(rows)
        self.capacity = PlanCapacity(
            decode_requests=max(buckets),
            decode_rows=max(b * choose_decode_splits(b, num_kv_heads, self.device) for b in buckets),
            tiles=self.plan_tiles, segments=segment_capacity(self.plan_tiles, rows),
            workspace_pages=graph_workspace_pages(self.plan_tiles, block_size, workspace_pages))
        cap = self.plan_tiles * Q_TILE
        with torch.inference_mode():
            self.params = {name: torch.zeros(rows, dtype=dtype, device=self.device) for name, dtype in params.items()}
            # Everything a step sends, in one buffer so that it goes in one copy (two staged copies cost 20-40 µs
            # more of host time on the H100/H200 boxes' CPUs): the token ids right-aligned in [0, cap) (a key's ids
            # end where the lengths begin, so its copy starts at its first id), query and sequence lengths [rows]
            # each, then the block tables (int32, column-major: a step copies only the columns its longest table
            # needs; max_model_len-wide rows were 16 MB per key at 131,072 tokens). Columns past them hold an earlier
            # step's pages, which nothing reads: page lists stop at a request's length and the page map masks the
            # rest (attention/metadata.py).
            self.staged = torch.zeros(cap + 2 * rows + -(-table_width * rows // 2), dtype=torch.int64,
                                      device=self.device)
            self.lens = self.staged[cap:cap + 2 * rows]
            self.tables_WR = self.staged[cap + 2 * rows:].view(torch.int32)[:table_width * rows]
        self.key_inputs: dict[MixedKey, tuple[torch.Tensor, torch.Tensor]] = {}  # per key: its copy's start, its ids
        self.decode_shape: dict[MixedKey, torch.Tensor] = {}  # per key: its padded decode requests and their rows
        self.graphs: dict[MixedKey, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[MixedKey, torch.Tensor] = {}
        # keys past max_tiles: the graph of their plan and metadata, and what it leaves (ids, positions, metadata)
        self.plan_graphs: dict[MixedKey, torch.cuda.CUDAGraph] = {}
        self.planned: dict[MixedKey, tuple] = {}
        # The pool-wide page lists, per mask: one set at capacity, which every key's graph writes (a plan graph's
        # outputs stay allocated while it lives: a set per key held ~2 GiB more at 31,000 pages, session 34; and the
        # decode rows' lists are written [rows, table width] into tables whose other columns stay zero, session 43)
        self.kept_lists: dict | None = None
        self.capture_seconds = 0.0

    def fits(self, key: MixedKey) -> bool:
        """Up to plan_tiles prefill tiles, with the graph's workspace (the runner pads a step to it when its
        contexts fit): a step that prefills over a longer cached prefix has long kernels, and runs without.
        And within the device plan's capacity (split-KV rows are chosen again at each step, from the environment).
        Wide q blocks only where the model runs eagerly (a whole graph is keyed without them)."""
        cap = self.capacity
        return (0 < key.num_tiles <= self.plan_tiles and key.workspace_pages == graph_workspace_pages(
                key.num_tiles, self.block_size, self.workspace_pages)
                and key.num_decode <= cap.decode_requests and key.num_decode * key.splits <= cap.decode_rows
                and key.num_segments <= cap.segments and (key.q_tiles == 1 or not self.whole(key)))

    def whole(self, key: MixedKey) -> bool:
        """Whether one graph holds the key's whole step (else only its plan and metadata)."""
        return key.num_tiles <= self.max_tiles

    def plan(self, key: MixedKey):
        """The step's plan and metadata over the static buffers, on the device: → (ids, positions, metadata)."""
        rows = self.rows
        query_lens, seq_lens = self.lens.split([rows, rows])
        tables = self.tables_WR.view(self.width, rows).t().clone(memory_format=torch.contiguous_format)  # (strides
        # as every step's tables: with one column, contiguous() kept the transposed view's)
        plan = (_compiled_plan() if self.device.type == "cuda" else plan_on_device)(
            query_lens, seq_lens, tables, self.decode_shape[key], self.capacity, self.block_size,
            align_pages(self.block_size), self.scratch_slot)
        v = key_views(plan, key.num_decode, key.splits, key.num_tiles, key.num_segments, key.workspace_pages)
        meta = metadata_on_device(key.layout(), {name: v[name] for name in LAYOUT_FIELDS}, tables, seq_lens.int(),
                                  v["slots"].clone(), self.block_size, self.num_blocks, self.params)
        meta.backend = self.backend
        if self.kept_lists is not None:  # (run makes them before a key's first plan)
            meta.backend_state["kept_lists"] = self.kept_lists
        self.backend.prepare(meta, self.mods)
        # Fresh tensors (no storage offset), as the ordinary step passes them: no new compiled variant.
        return self.inputs_of(key)[1].clone(), v["positions"].clone(), meta

    def forward(self, key: MixedKey) -> torch.Tensor:
        """The whole step over the static buffers: the plan and the metadata on the device, then the model."""
        return self.run_model(*self.plan(key))

    def inputs_of(self, key: MixedKey) -> tuple[torch.Tensor, torch.Tensor]:
        """(the staged buffer from the key's first id on, which a step's one copy fills; its ids [num_tokens])."""
        if key not in self.key_inputs:
            first = self.plan_tiles * Q_TILE - key.num_tokens
            self.key_inputs[key] = self.staged[first:], self.staged[first:first + key.num_tokens]
        return self.key_inputs[key]

    @torch.inference_mode()
    def run(self, ids, query_lens, seq_lens, tables, key: MixedKey, params: dict[str, torch.Tensor],
            feed=None) -> torch.Tensor:
        """Hidden states [T, H] of one step that `fits` its key; captures the key's graph the first time.
        query_lens: int64 [R <= rows]; seq_lens: int32 [rows], 0 past the step's R requests; tables [rows, <= width].
        feed(input_ids): writes input ids known only on the device (async scheduling) into the buffer."""
        assert self.fits(key), key
        if key not in self.decode_shape:
            self.decode_shape[key] = torch.tensor([key.num_decode, key.splits], device=self.device)
        n, t, rows, R, cols = len(ids), key.num_tokens, self.rows, len(query_lens), tables.shape[1]
        assert n <= t and R <= rows == len(seq_lens) == tables.shape[0] and cols <= self.width, \
            (n, key, R, len(seq_lens), tables.shape, rows, self.width)
        # inputs_of(key)'s leading part: ids (zeros pad them: the padding tokens'), lengths, the tables' columns
        packed = np.empty(t + 2 * rows + -(-cols * rows // 2), dtype=np.int64)
        packed[:n], packed[n:t] = ids, 0
        packed[t:t + R], packed[t + R:t + rows], packed[t + rows:t + 2 * rows] = query_lens, 0, seq_lens
        words = 2 * (t + 2 * rows)
        packed.view(np.int32)[words:words + cols * rows].reshape(cols, rows)[...] = tables.T
        start, key_ids = self.inputs_of(key)
        copy_into(packed, start, self.device)
        if feed is not None:
            feed(key_ids)
        for name, buf in self.params.items():
            assert params[name].dtype == buf.dtype, (name, params[name].dtype, buf.dtype)
            buf.copy_(params[name][: self.rows])
        if not self.whole(key):
            return self.run_model(*self.planned_step(key))[:n]
        if key in self.graphs:
            self.graphs[key].replay()
            return self.hidden[key][:n]
        self.keep_lists()
        hidden = self.forward(key)
        if self.use_graphs:
            self.capture(key)
        return hidden[:n]

    def planned_step(self, key: MixedKey):
        """plan(key) from the key's graph (captured the first time), or eagerly without graphs."""
        if key in self.plan_graphs:
            self.plan_graphs[key].replay()
            return self.planned[key]
        self.keep_lists()
        planned = self.plan(key)  # (eagerly first: what compiles on first use does so outside the capture)
        if not self.use_graphs:
            return planned
        start = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        with graph_capture(graph, self.pool):
            self.planned[key] = self.plan(key)
        self.plan_graphs[key] = graph
        self.capture_seconds += time.perf_counter() - start
        graph.replay()  # (capture runs nothing)
        return self.planned[key]

    def keep_lists(self) -> None:
        """The kept page-list tables at the plan's capacity, made at a key's first (eager) run, before any capture."""
        if self.kept_lists is None:
            rows = {"decode": self.capacity.decode_rows, "prefill": self.capacity.tiles}
            self.kept_lists = kept_page_lists(self.mods, rows, self.num_blocks, self.device)

    def capture(self, key: MixedKey) -> None:
        start = time.perf_counter()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with graph_capture(graph, self.pool):
            self.hidden[key] = self.forward(key)
        self.graphs[key] = graph
        seconds = time.perf_counter() - start
        self.capture_seconds += seconds
        logger.debug("captured a CUDA graph for %s in %.3f s (%d mixed graphs)", key, seconds, len(self.graphs))


# On CUDA the plan is one Inductor graph (a few kernels inside each mixed graph, not a launch per op); its shapes are
# the capacity's, so every key shares it.
_compiled_plan = compiled_on_first_use(plan_on_device, pdl=False)  # (steps with prompt tokens only)
