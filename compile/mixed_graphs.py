"""CUDA graphs for steps that carry prompt tokens: a prompt arriving at a busy server, a chunk of one.

Without a graph such a step launches every kernel of the model from Python: about 800 launches, 25 ms
of host time for 6 ms of GPU work when one 256-token prompt joins 32 decoding requests on the H100
(docs/benchmarks.md). Every decoding request waits for that step, so it set the server's TPOT.

A graph's shapes are fixed by the step's layout buckets (decode rows, their split-KV count, prefill
tiles and segments): the tokens are padded to `num_tiles * Q_TILE` (pack_step already does), padded
tokens write their K/V to the scratch slot, and the page lists and BlockMasks are built on the device
inside the graph from static buffers, as in the decode graphs. The host packs the step into one array and copies it in, with
the block tables beside it.
The engine captures every key at start-up (compile/warmup.capture_mixed_graphs); a key met later
anyway is captured then (that step runs the same code eagerly and uses its result). Steps with more
than `max_tiles` prefill tiles run without a graph: their launches are spread over many tokens.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..attention.metadata import LAYOUT_FIELDS, metadata_on_device
from ..attention.layout import KV_TILE, Q_TILE, StepLayout
from ..attention.staging import copy_into
from .cuda_graphs import graph_capture

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

    @classmethod
    def of(cls, layout: StepLayout) -> "MixedKey":
        return cls(layout.num_decode, layout.decode_splits, layout.num_tiles, layout.num_segments, len(layout.ws_req),
                   layout.kernel_splits)

    @property
    def num_tokens(self) -> int:
        """Token capacity: whole tiles, decode tokens included."""
        return self.num_tiles * Q_TILE

    def field_sizes(self) -> dict[str, int]:
        """Length of each layout array for this key (layout.plan_layout's padding)."""
        rows = self.num_decode * self.splits
        spans, prefill = rows + self.num_segments, self.num_tokens
        return {"decode_req": rows, "span_req": spans, "span_q_lo": spans, "span_q_hi": spans, "span_valid": spans,
                "span_split": spans, "span_kv0": spans, "seg_tile": self.num_segments, "tile_single": self.num_tiles,
                "prefill_req": prefill, "prefill_pos": prefill, "prefill_kv0": prefill, "decode_src": rows,
                "decode_dst": self.num_decode, "ws_req": self.workspace_pages, "ws_page": self.workspace_pages}


class MixedBuffers:
    """One key's static inputs: a packed int64 buffer (ids, positions, slots, lengths, layout)."""

    def __init__(self, key: MixedKey, rows: int, layout: StepLayout, device):
        T = key.num_tokens
        self.sizes = {"ids": T, "positions": T, "slots": T, "seq_lens": rows, **key.field_sizes()}
        self.packed = torch.zeros(sum(self.sizes.values()), dtype=torch.int64, device=device)
        self.views = dict(zip(self.sizes, self.packed.split(list(self.sizes.values()))))
        self.device = device  # the engine's, so the copies share its pinned staging ring
        # The backend reads only the layout's counts; host lists that would be stale are emptied.
        self.layout = dataclasses.replace(layout, query_lens=[], seq_lens=[], num_tokens=T)

    def fill(self, ids, positions, slots, seq_lens, layout: StepLayout, scratch_slot: int) -> None:
        T, n = self.sizes["ids"], len(ids)
        assert n <= T, (n, T)
        pad = T - n
        parts = [ids, np.zeros(pad, np.int64), positions, np.zeros(pad, np.int64), slots,
                 np.full(pad, scratch_slot, np.int64), seq_lens]
        for name in LAYOUT_FIELDS:
            array = getattr(layout, name)
            assert len(array) == self.sizes[name], (name, len(array), self.sizes[name])
            parts.append(array)
        copy_into(np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]), self.packed, self.device)


class MixedGraphRunner:
    """Runs `run_model(input_ids, positions, meta) -> hidden` for steps with prompt tokens from graphs."""

    def __init__(self, run_model, backend, mods, *, rows: int, table_width: int, block_size: int, num_blocks: int,
                 params: dict[str, torch.dtype], scratch_slot: int, device, workspace_pages: int | None = None,
                 pool=None, max_tiles: int = MAX_GRAPH_TILES, use_graphs: bool = True):
        self.run_model, self.backend, self.mods = run_model, backend, mods
        self.rows, self.width, self.block_size, self.num_blocks = rows, table_width, block_size, num_blocks
        self.scratch_slot, self.max_tiles, self.workspace_pages = scratch_slot, max_tiles, workspace_pages
        self.device = torch.device(device)
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self.pool = pool
        with torch.inference_mode():
            self.params = {name: torch.zeros(rows, dtype=dtype, device=self.device) for name, dtype in params.items()}
        self.buffers: dict[MixedKey, MixedBuffers] = {}
        # Block tables, shared by every key, column-major: a step copies only the columns its longest
        # table needs (max_model_len-wide rows were 16 MB per key at 131,072 tokens). Columns past them
        # hold an earlier step's pages, which nothing reads: page lists stop at a request's length and
        # the page map masks the rest (attention/metadata.py).
        self.tables_WR = torch.zeros(table_width * rows, dtype=torch.int32, device=self.device)
        self.graphs: dict[MixedKey, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[MixedKey, torch.Tensor] = {}
        self.capture_seconds = 0.0

    def fits(self, layout: StepLayout) -> bool:
        """Up to max_tiles prefill tiles, with the graph's workspace (the runner pads a step to it when its
        contexts fit): a step that prefills over a longer cached prefix has long kernels, and runs without."""
        return 0 < layout.num_tiles <= self.max_tiles and len(layout.ws_req) == graph_workspace_pages(
            layout.num_tiles, self.block_size, self.workspace_pages)

    def forward(self, key: MixedKey) -> torch.Tensor:
        """The step over the key's static buffers: metadata on the device, then the model."""
        b = self.buffers[key]
        v = b.views
        meta = metadata_on_device(b.layout, {name: v[name] for name in LAYOUT_FIELDS},
                                  self.tables_WR.view(self.width, self.rows).t().contiguous(), v["seq_lens"].int(),
                                  v["slots"].clone(), self.block_size, self.num_blocks, self.params)
        meta.backend = self.backend
        self.backend.prepare(meta, self.mods)
        # Fresh tensors (no storage offset), as the ordinary step passes them: no new compiled variant.
        return self.run_model(v["ids"].clone(), v["positions"].clone(), meta)

    @torch.inference_mode()
    def run(self, ids, positions, slots, tables, seq_lens, layout: StepLayout,
            params: dict[str, torch.Tensor], feed=None) -> torch.Tensor:
        """Hidden states [T, H] of one step whose layout `fits`; captures its graph the first time.
        feed(input_ids): writes input ids known only on the device (async scheduling) into the buffer."""
        key = MixedKey.of(layout)
        if key not in self.buffers:
            self.buffers[key] = MixedBuffers(key, self.rows, layout, self.device)
        self.buffers[key].fill(ids, positions, slots, seq_lens, layout, self.scratch_slot)
        assert tables.shape[0] == self.rows and tables.shape[1] <= self.width, (tables.shape, self.rows, self.width)
        copy_into(np.ascontiguousarray(tables.T).ravel(), self.tables_WR, self.device)
        if feed is not None:
            feed(self.buffers[key].views["ids"])
        for name, buf in self.params.items():
            assert params[name].dtype == buf.dtype, (name, params[name].dtype, buf.dtype)
            buf.copy_(params[name][: self.rows])
        n = len(ids)
        if key in self.graphs:
            self.graphs[key].replay()
            return self.hidden[key][:n]
        hidden = self.forward(key)
        if self.use_graphs:
            self.capture(key)
        return hidden[:n]

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
