"""A pure decode step's inputs on the host: the whole batch packed into one array, or, in the steady state
where the batch is the last decode step's one token on, only what changed.

Packing 256 requests' ids, positions, slots, lengths and block tables took 405 µs of host time per decode
step on the H100 box (docs/benchmarks.md, session 13). When the batch has not changed, the decode graphs'
buffers already hold all of it one token back: they move on by themselves on the device (compile/cuda_graphs.py's
take_inputs, inside the graph, as multi-step decode does), and the host sends only the input ids and the pages
appended since (vLLM keeps a persistent batch for the same reason).
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import is_not, itemgetter, lt, sub

import numpy as np

from .block_tables import batch_tables
from .sequence import block_table_of, token_ids_of


_last = itemgetter(-1)


def last_tokens(seqs) -> np.ndarray:
    return np.array(list(map(_last, map(token_ids_of, seqs))), dtype=np.int64)


def pack_decode(seqs, block_size: int, columns: int = 0, block_tables=None, rows=None) -> np.ndarray:
    """[4 + width, max(R, columns)] int64: ids, positions, slots, lengths, then the block tables transposed (a
    column per request, only as wide as the longest table; columns past a request's last page are never read);
    columns past R are zeros. block_tables: the block manager's rows of the tables (engine/block_tables.py), else
    the sequences' lists are read (rows: the sequences' rows there, block_tables.table_rows, when the caller has them)."""
    P, R = block_size, len(seqs)
    token_lists = list(map(token_ids_of, seqs))  # (one map each: a generator's frame per request cost twice as much)
    tables = batch_tables(block_tables, seqs, index=rows)
    packed = np.zeros((4 + tables.shape[1], max(R, columns)), dtype=np.int64)
    packed[4:, :R] = tables.T
    pos = np.array(list(map(len, token_lists)), dtype=np.int64) - 1
    packed[0, :R] = list(map(_last, token_lists))
    packed[1, :R], packed[3, :R] = pos, pos + 1
    packed[2, :R] = packed[4 + pos // P, np.arange(R)] * P + pos % P
    return packed


@dataclass
class MovedOn:
    """A decode step whose batch is the last one's, each request one token on (some may have left, the rest may be
    in another order: `src`)."""
    seqs: list
    new_pages: np.ndarray  # int64 [3, k]: row, table column and page of each page appended since
    src: np.ndarray | None = None  # int64 [R]: each row's row in the last batch; None: its own (the same batch)
    last_seqs: list | None = None  # the last batch (its sequences in its rows)

    @property
    def ids(self) -> np.ndarray:
        """int64 [R]: each row's input token (a PENDING one is fed on the device). Made only when asked: with
        async scheduling every row's token is the last step's sample, already on the device."""
        return last_tokens(self.seqs)


@dataclass
class _Step:
    seqs: list
    tables: list[list[int]]  # the block table objects themselves: a freed sequence gets a new one
    lens: list[int]
    num_tokens: list[int]


class DecodeTracker:
    """Remembers the batch the decode graphs' buffers hold, to tell whether the next decode step is that
    batch moved on. The runner forgets it whenever anything else writes those buffers."""

    def __init__(self):
        self.last: _Step | None = None

    def forget(self) -> None:
        self.last = None

    def next_step(self, seqs) -> MovedOn | None:
        """Record `seqs` as the batch the buffers hold after this step. Returns the step's changes when `seqs` is
        the last step's batch, or some of it in any order (requests that finished left), each request one token
        further and its block table only grown; else None (pack the whole batch)."""
        # Plain lists, each made by one map in C: np.fromiter over the same maps took about twice as long (256
        # requests on the H100 box: 79 -> 43 us median, session 33), and most steps compare equal lists only.
        seqs = list(seqs)
        tables = list(map(block_table_of, seqs))
        num_tokens = list(map(len, map(token_ids_of, seqs)))
        lens = list(map(len, tables))
        last, self.last = self.last, _Step(seqs, tables, lens, num_tokens)
        if last is None:
            return None
        src = None
        if seqs != last.seqs:  # (a Sequence compares by identity)
            # In ragged traffic most decode steps are the last one less the requests that finished: each row then
            # takes its place in the last batch along (the graph gathers its buffers' rows, cuda_graphs.take_inputs)
            where = dict(zip(last.seqs, range(len(last.seqs))))  # (a Sequence hashes by identity)
            rows = list(map(where.get, seqs))
            if None in rows:
                return None
            src = np.array(rows, dtype=np.int64)
            pick = itemgetter(*rows) if len(rows) > 1 else lambda items: (items[rows[0]],)
            last = _Step(last.seqs, list(pick(last.tables)), list(pick(last.lens)), list(pick(last.num_tokens)))
        # (`is_not` maps over the tables: a freed and allocated sequence has a new one)
        if any(map(is_not, tables, last.tables)):
            return None
        if list(map(sub, num_tokens, last.num_tokens)).count(1) != len(seqs):
            return None
        moved = MovedOn(seqs, np.zeros((3, 0), dtype=np.int64), src, last.seqs)
        if lens == last.lens:  # no page appended since (most steps)
            return moved
        if any(map(lt, lens, last.lens)):
            return None
        new = [(i, j, tables[i][j]) for i, (n, m) in enumerate(zip(lens, last.lens)) if n != m for j in range(m, n)]
        moved.new_pages = np.asarray(new, dtype=np.int64).reshape(-1, 3).T.copy()
        return moved
