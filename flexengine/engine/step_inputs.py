"""A step with prompt tokens on the host: the scheduled batch as arrays, before any device work.

pack_lengths walks the requests once (ids, lengths, block tables, which rows sample); that is all a mixed CUDA graph
needs, since it plans the rest on the device (attention/device_plan.py). plan_step adds what the other steps read on
the host: each token's position and KV slot and the layout (attention/layout.plan_layout).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from operator import getitem

import numpy as np

from ..attention.layout import StepLayout, plan_layout
from .block_tables import batch_tables, table_rows
from .scheduler import ScheduledBatch
from .sequence import Sequence, num_computed_of, token_ids_of


@dataclass
class PackedStep:
    """One step's inputs on the host. pack_lengths fills the requests' part, plan_step the rest."""
    ids: np.ndarray                   # int64 [T]
    query_lens: np.ndarray            # int64 [R]
    tables: np.ndarray                # int32 [rows, width]
    seq_lens: np.ndarray              # int32 [rows]; 0 for padding rows
    sample_seqs: list[Sequence]
    sample_rows: np.ndarray           # int64 [N]
    last_rows: np.ndarray             # int64 [R]: each sequence's last token in the packed batch
    table_rows: np.ndarray | None     # int64 [R]: each sequence's BlockTables row (None: no rows, dummy sequences)
    positions: np.ndarray | None = None  # int64 [T], then padding (plan_step)
    slots: np.ndarray | None = None      # int64 [T], then padding
    layout: StepLayout | None = None


def pack_lengths(batch: ScheduledBatch, min_rows: int = 0) -> PackedStep:
    """The scheduled tokens' ids, each request's lengths and block table, and which rows sample; the per-request
    arrays have at least `min_rows` rows (padding: length 0, no pages)."""
    seqs = batch.seqs
    R = len(seqs)
    # Every walk over the requests is one map in C, no Python frame per request (~11 µs a field at 256 requests on
    # the dev CPU); with the ids sliced from the prompts' arrays and the tables gathered from the block manager's
    # rows, those walks are most of what is left (~250 µs at 256 requests on an H200 box's CPU, session 34)
    starts = np.fromiter(map(num_computed_of, seqs), dtype=np.int64, count=R)
    query_lens = np.array(batch.num_new_tokens, dtype=np.int64)
    seq_lens = starts + query_lens
    token_lists = list(map(token_ids_of, seqs))
    ends = np.cumsum(query_lens)
    # Each request's last scheduled token (a decode row's only one), then the longer chunks over them: slices of
    # the prompts' arrays (np.fromiter over the Python ints of 8,192 prompt tokens took 190 µs on the dev CPU)
    ids = np.empty(int(ends[-1]), dtype=np.int64)
    ids[ends - 1] = list(map(getitem, token_lists, (seq_lens - 1).tolist()))
    chunks = np.flatnonzero(query_lens > 1).tolist()
    if chunks:
        ids[np.repeat(query_lens > 1, query_lens)] = np.concatenate(
            [chunk_ids(seqs[i], int(starts[i]), int(seq_lens[i])) for i in chunks])
    # Only as wide as the longest table: a max_model_len-wide one is megabytes per step at long contexts. The
    # device side widens it where a fixed shape needs that (ModelRunner.prepare_step).
    rows = max(R, min_rows)
    index = table_rows(seqs) if batch.block_tables is not None else None
    tables = batch_tables(batch.block_tables, seqs, rows, index)
    padded_lens = np.zeros(rows, dtype=np.int32)
    padded_lens[:R] = seq_lens
    # A sequence gets a token when this step computes its last known token (its prompt is done).
    done = np.flatnonzero(seq_lens == np.fromiter(map(len, token_lists), dtype=np.int64, count=R))
    sample_seqs = list(seqs) if len(done) == R else list(map(seqs.__getitem__, done.tolist()))
    return PackedStep(ids, query_lens, tables, padded_lens, sample_seqs, ends[done] - 1, ends - 1, index)


def chunk_ids(seq: Sequence, start: int, stop: int) -> np.ndarray:
    """The ids of tokens [start, stop) of `seq`: a slice of its prompt's array where they are prompt tokens."""
    prompt = seq.prompt_array
    if prompt is not None and stop <= len(prompt):
        return prompt[start:stop]
    return np.array(seq.token_ids[start:stop], dtype=np.int64)


def plan_step(p: PackedStep, block_size: int, padding: dict, scratch_slot: int | None) -> PackedStep:
    """`p` with each token's position and slot and the layout (plan_layout with `padding`); with a `scratch_slot`,
    the tokens padded to the layout's token capacity (id 0 at position 0, their K/V to that slot)."""
    P, query_lens = block_size, p.query_lens
    R, T = len(query_lens), len(p.ids)
    seq_lens = p.seq_lens[:R].astype(np.int64)
    starts = p.last_rows + 1 - query_lens  # each request's first token in the packed batch
    req = np.repeat(np.arange(R), query_lens)
    positions = np.repeat(seq_lens - query_lens - starts, query_lens) + np.arange(T)
    slots = p.tables[req, positions // P].astype(np.int64) * P + positions % P
    layout = plan_layout(query_lens, seq_lens, **padding)
    ids, pad = p.ids, layout.token_capacity - T if scratch_slot is not None else 0
    if pad:
        zeros = np.zeros(pad, dtype=np.int64)  # (np.pad took 50 µs for the three)
        ids, positions = np.concatenate([ids, zeros]), np.concatenate([positions, zeros])
        slots = np.concatenate([slots, np.full(pad, scratch_slot, dtype=np.int64)])
    return dataclasses.replace(p, ids=ids, positions=positions, slots=slots, layout=layout)
