"""A launched step whose sampled tokens are still on their way to the host.

With async scheduling the engine launches step N+1 before it reads step N's tokens: the host then
detokenizes, checks stops and streams N's outputs while the GPU runs N+1. Step N+1 already holds a
PENDING placeholder for each token of step N; `feed` gives the device rows that take their input from
step N's samples, which never leave the device for that. Without async scheduling the engine reads a
step back right after launching it, through the same object.
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

import numpy as np
import torch

from ..attention.staging import to_device
from ..layers.sampler import SamplerOutput
from .prompt_logprobs import PromptLogprobs
from .block_tables import table_rows
from .scheduler import ScheduledBatch
from .sequence import NO_ROW, Sequence, table_row_of


_num_pending, _seq_id = attrgetter("num_pending"), attrgetter("seq_id")


@dataclass
class InFlightStep:
    batch: ScheduledBatch
    seqs: list[Sequence]                 # the sequences that sample a token, in row order
    out: SamplerOutput | None            # on the device
    host: list[torch.Tensor]             # token ids (then logprob tensors), copying to the host
    copied: torch.cuda.Event | None      # recorded after the copies; None on the CPU
    row_of: dict[int, int]               # seq_id → its row in out.token_ids
    prompt: PromptLogprobs | None = None  # prompt-token logprobs of the sequences that asked
    prompt_host: list[torch.Tensor] | None = None

    @classmethod
    def launch(cls, batch: ScheduledBatch, seqs: list[Sequence], out: SamplerOutput | None,
               prompt: PromptLogprobs | None = None) -> "InFlightStep":
        """Start copying the step's samples (and prompt logprobs) to the host; the step itself is queued
        on the device."""
        host, copied = [], None
        if out is not None:
            parts = [out.token_ids]
            if out.logprob is not None:
                parts += [out.logprob, out.rank, out.top_ids, out.top_logprobs]
            host = [t.to("cpu", non_blocking=True) for t in parts]  # pinned on CUDA: no wait here
        prompt_host = None if prompt is None else [t.to("cpu", non_blocking=True) for t in prompt.tensors()]
        if (out is not None and out.token_ids.is_cuda) or (prompt is not None and prompt.chosen.is_cuda):
            copied = torch.cuda.Event()
            copied.record()
        return cls(batch, seqs, out, host, copied, {s.seq_id: i for i, s in enumerate(seqs)}, prompt, prompt_host)

    def wait(self) -> tuple[list[int], list[tuple] | None]:
        """The sampled token ids, and per row (logprob, rank, top ids, top logprobs) when asked for."""
        if self.copied is not None:
            self.copied.synchronize()  # only this step: the one launched after it keeps running
        if not self.host:
            return [], None
        lists = [t.tolist() for t in self.host]
        return lists[0], (list(zip(*lists[1:])) if len(lists) > 1 else None)

    def prompt_spans(self) -> list[tuple[Sequence, int, tuple[np.ndarray, ...]]]:
        """After wait(): per sequence that asked, (it, first prompt position scored, the arrays of its
        positions: logprob, rank, top ids [n, K], top logprobs [n, K])."""
        if self.prompt is None:
            return []
        arrays = [t.numpy() for t in self.prompt_host]
        spans, at = [], 0
        for seq, first, count in self.prompt.spans:
            spans.append((seq, first, tuple(a[at:at + count] for a in arrays)))
            at += count
        return spans

    def feed(self, seqs: list[Sequence], last_rows, device, rows: np.ndarray | None = None) \
            -> tuple[torch.Tensor | None, torch.Tensor] | None:
        """(rows, token ids) on the device: the input rows (each sequence's last, at `last_rows`; None: row i is
        sequence i's, as in a decode step) whose token is this step's still-pending sample, and that sample; rows
        None: the leading rows, one per sample in order (a decode step of the same sequences, the usual case: no
        transfer). None when no row waits on this step. rows: the sequences' BlockTables rows, when the caller has
        them (step_inputs.PackedStep.table_rows)."""
        if seqs == self.seqs and all(map(_num_pending, seqs)) and \
                (last_rows is None or np.array_equal(np.asarray(last_rows), np.arange(len(seqs)))):
            return None, self.out.token_ids
        if rows is None:
            rows = table_rows(seqs)
        if rows is None:  # (dummy sequences, with no rows: warm-up, KV sizing)
            waiting = np.flatnonzero(np.fromiter(map(_num_pending, seqs), dtype=np.int64, count=len(seqs)))
            samples = np.fromiter(map(self.row_of.__getitem__, map(_seq_id, map(seqs.__getitem__, waiting.tolist()))),
                                  dtype=np.int64, count=len(waiting))
        else:
            sample_of = self.samples_by_row(rows)
            waiting = np.flatnonzero(sample_of >= 0)
            samples = sample_of[waiting]
        if not len(waiting):
            return None
        index = np.empty((2, len(waiting)), dtype=np.int64)
        index[0] = waiting if last_rows is None else np.asarray(last_rows)[waiting]
        index[1] = samples
        index = to_device(index, device)
        return index[0], self.out.token_ids.index_select(0, index[1])

    def samples_by_row(self, rows: np.ndarray) -> np.ndarray:
        """For each BlockTables row in `rows`, the row of out.token_ids its sequence waits on, or -1. A sequence holds
        its row from admission until it finishes or is preempted, and one of this step's holds a pending token until
        the step is read (it is not admitted again before), so a row held now by one of this step's sequences is
        exactly one whose input is that sequence's sample: one map over this step's sequences, where walking the
        next step's pending counts and ids took ~150 µs at 256 requests (H200 box, session 35)."""
        mine = np.array(list(map(table_row_of, self.seqs)), dtype=np.int64)  # NO_ROW: finished or preempted since
        held = np.flatnonzero(mine != NO_ROW)
        sample_of = np.full(int(max(rows.max(initial=0), mine.max(initial=0))) + 1, -1, dtype=np.int64)
        sample_of[mine[held]] = held
        return sample_of[rows]


def feed_inputs(input_ids: torch.Tensor, fed: tuple[torch.Tensor | None, torch.Tensor] | None) -> None:
    """Write the pending tokens' values into a step's input ids, on the device."""
    if fed is None:
        return
    rows, values = fed
    if rows is None:
        input_ids[:len(values)].copy_(values)
    else:
        input_ids.index_copy_(0, rows, values)
