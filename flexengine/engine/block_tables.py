"""Every page-holding sequence's block table as a row of one numpy array (vLLM keeps its InputBatch's block table
the same way), so that a step reads its batch's tables with one gather instead of walking each sequence's list.

The block manager writes a row as it hands pages out and clears it when it frees them; `Sequence.block_table` stays
the list its bookkeeping reads. Reading 256 requests' tables from their lists was 60-140 µs of pack_lengths'
(step_inputs.py) ~240 on the dev CPU (timings there move 2x between runs), most of it turning the lists' Python ints
into an array; the gather takes ~25.
"""
from __future__ import annotations

from itertools import chain

import numpy as np

from .sequence import NO_ROW, block_table_of, table_row_of


class BlockTables:
    """Rows of pages, int32 [rows, width], and each row's page count; both grow (doubling) when a sequence needs
    more, so no bound on the batch or the context is needed up front."""

    def __init__(self, rows: int = 16, width: int = 16):
        self.pages_RW = np.zeros((rows, width), dtype=np.int32)
        self.lens = np.zeros(rows, dtype=np.int64)
        self.free_rows = list(range(rows - 1, -1, -1))  # (popped from the end: row 0 first)

    def extend(self, seq, pages: list[int]) -> None:
        """Append `pages` to `seq`'s row (taking a row for a sequence that holds none)."""
        if seq.table_row == NO_ROW:
            if not self.free_rows:
                self._grow(rows=2 * len(self.lens))
            seq.table_row = self.free_rows.pop()
        row, n = seq.table_row, int(self.lens[seq.table_row])
        if n + len(pages) > self.pages_RW.shape[1]:
            self._grow(width=max(2 * self.pages_RW.shape[1], n + len(pages)))
        self.pages_RW[row, n:n + len(pages)] = pages
        self.lens[row] = n + len(pages)

    def release(self, seq) -> None:
        """Clear `seq`'s row (zeros past a table are what a step's padded tables hold) and give it back."""
        if seq.table_row == NO_ROW:
            return
        row, seq.table_row = seq.table_row, NO_ROW
        self.pages_RW[row, : self.lens[row]] = 0
        self.lens[row] = 0
        self.free_rows.append(row)

    def gather(self, index: np.ndarray, rows: int) -> np.ndarray:
        """The tables of the sequences in rows `index` (table_rows), int32 [max(len(index), rows), the longest one's
        width]."""
        width = int(self.lens[index].max())
        tables = np.zeros((max(len(index), rows), width), dtype=np.int32)
        tables[: len(index)] = self.pages_RW[:, :width].take(index, axis=0)
        return tables

    def _grow(self, rows: int | None = None, width: int | None = None) -> None:
        old_rows, old_width = self.pages_RW.shape
        rows, width = rows or old_rows, width or old_width
        pages = np.zeros((rows, width), dtype=np.int32)
        pages[:old_rows, :old_width] = self.pages_RW
        self.pages_RW = pages
        self.lens = np.concatenate([self.lens, np.zeros(rows - old_rows, dtype=np.int64)])
        self.free_rows = list(range(rows - 1, old_rows - 1, -1)) + self.free_rows


def table_rows(seqs: list) -> np.ndarray | None:
    """Each sequence's BlockTables row, int64 [len(seqs)], or None when one of them holds none (warm-up and profiling
    dummies fill their lists themselves)."""
    index = np.fromiter(map(table_row_of, seqs), dtype=np.int64, count=len(seqs))
    return None if (index == NO_ROW).any() else index


def table_entries(tables: list[list[int]]):
    """Every page of every block table at once: (row, column, page) flat, and each table's length."""
    lens = np.array(list(map(len, tables)), dtype=np.int64)
    row = np.repeat(np.arange(len(tables)), lens)
    col = np.arange(len(row)) - np.repeat(np.cumsum(lens) - lens, lens)
    return row, col, np.array(list(chain.from_iterable(tables)), dtype=np.int64), lens


def batch_tables(block_tables: BlockTables | None, seqs: list, rows: int = 0, index: np.ndarray | None = None) \
        -> np.ndarray:
    """The sequences' block tables, int32 [max(R, rows), the longest one's width], zeros past each: one gather from
    the block manager's rows (`index`: their table_rows, when the caller has them), or (dummy sequences, or no
    BlockTables) from their lists."""
    if index is None and block_tables is not None:
        index = table_rows(seqs)
    if index is not None:
        return block_tables.gather(index, rows)
    row, col, page, lens = table_entries(list(map(block_table_of, seqs)))
    tables = np.zeros((max(len(seqs), rows), int(lens.max())), dtype=np.int32)
    tables[row, col] = page
    return tables
