"""One step's logits processors (penalties, logit_bias, min_tokens): host lists → the device tensors of
layers/sampler.LogitsAdjust.

Penalties read a request's whole history, which grows by a token a step. `PenaltyHistories` keeps each
penalised sequence's token ids on the device, in a slot of its own, and a step sends only the tokens its
rows gained since the last one; the sampler then applies the penalties at the history's positions, not
over the vocabulary. With async scheduling a row's last token may still be PENDING on the host: its value
is on the device (the step in flight sampled it) and is written into the slot there.
"""
from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from ..attention.staging import to_device
from ..layers.sampler import LogitsAdjust
from .sequence import PENDING, Sequence


def has_penalties(p) -> bool:
    return p.repetition_penalty != 1 or bool(p.frequency_penalty or p.presence_penalty)


class PenaltyHistories:
    """Token ids (prompt and output) of up to `num_slots` penalised sequences, on the device.

    hist_SC [slots, capacity]: slot s holds its sequence's tokens in order; the columns past them repeat
    its first token, so every column is one of the row's tokens and writing a penalised value there twice
    writes the same value. A sequence keeps its slot while it is scheduled; slots of sequences no step
    has named since are taken back when the slots run out (a returning sequence is written again whole)."""

    def __init__(self, num_slots: int, device):
        self.num_slots, self.device = num_slots, torch.device(device)
        self.hist_SC = torch.zeros(num_slots, 0, dtype=torch.int64, device=self.device)
        self.slot_of: dict[int, int] = {}    # seq_id → slot
        self.written: dict[int, int] = {}    # seq_id → how many of its token ids its slot holds
        # the last update's (seq ids, step rows, its rows on the device, slots, prompt lengths, lengths, longest):
        # a step whose rows each gained just the PENDING token in flight writes it on the device (moved_on)
        self.last: tuple | None = None

    def grow(self, capacity: int) -> None:
        old = self.hist_SC
        if capacity <= old.shape[1]:
            return
        capacity = max(256, 1 << (capacity - 1).bit_length())
        self.hist_SC = torch.empty(self.num_slots, capacity, dtype=torch.int64, device=self.device)
        self.hist_SC[:, :old.shape[1]] = old
        self.hist_SC[:, old.shape[1]:] = old[:, :1] if old.shape[1] else 0

    def assign(self, seqs: list[Sequence]) -> list[int]:
        """A slot for each sequence (new ones start empty)."""
        step = {s.seq_id for s in seqs}
        assert len(step) <= self.num_slots, (len(step), self.num_slots)
        free = sorted(set(range(self.num_slots)) - set(self.slot_of.values()))
        for s in seqs:
            if s.seq_id in self.slot_of:
                continue
            if not free:  # take back the slots of sequences this step does not name
                for gone in [i for i in self.slot_of if i not in step]:
                    free.append(self.slot_of.pop(gone))
                    del self.written[gone]
            self.slot_of[s.seq_id], self.written[s.seq_id] = free.pop(), 0
        return [self.slot_of[s.seq_id] for s in seqs]

    def update(self, seqs: list[Sequence], batch_rows: list[int], pending, num_rows: int):
        """Write what these sequences (rows `batch_rows` of a step of `num_rows`) gained since the last step;
        returns (slots, prompt lengths, lengths), each [P] on the device, and the longest length. pending:
        (rows or None, values) of the step's PENDING tokens, or None."""
        ids = [s.seq_id for s in seqs]
        if self.last is not None and self.last[0] == ids and self.last[1] == batch_rows and all(
                len(s.token_ids) == self.written[s.seq_id] + 1 and s.token_ids[-1] == PENDING for s in seqs):
            return self.moved_on(seqs, pending, num_rows)
        slots = self.assign(seqs)
        lengths = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=len(seqs))
        starts = np.fromiter((self.written[s.seq_id] for s in seqs), dtype=np.int64, count=len(seqs))
        longest = int(lengths.max())
        self.grow(longest)
        # Every token a slot gains, flat: (slot, column, token id), or (step row, slot, column) for a PENDING one.
        # One pass in numpy: a sequence's first step brings its whole prompt (256 x 256 tokens took 15 ms of
        # Python on the development CPU, once per sequence).
        gained = lengths - starts
        tokens = np.fromiter(chain.from_iterable(s.token_ids[a:] for s, a in zip(seqs, starts.tolist())),
                             dtype=np.int64, count=int(gained.sum()))
        host_slots = np.asarray(slots, dtype=np.int64)
        slot_T, row_T = np.repeat(host_slots, gained), np.repeat(np.asarray(batch_rows, dtype=np.int64), gained)
        col_T = np.arange(len(tokens)) - np.repeat(np.cumsum(gained) - gained - starts, gained)
        wait = tokens == PENDING
        new = starts == 0  # a new slot: its first token fills the columns past its history
        first = np.fromiter((s.token_ids[0] for s in seqs), dtype=np.int64, count=len(seqs))
        fills = np.stack([host_slots[new], first[new]])
        known = np.stack([slot_T[~wait], col_T[~wait], tokens[~wait]])
        waiting = np.stack([row_T[wait], slot_T[wait], col_T[wait]])
        for s, n in zip(seqs, lengths.tolist()):
            self.written[s.seq_id] = n
        P, F, K, W = len(seqs), fills.shape[1], known.shape[1], waiting.shape[1]
        packed = np.concatenate([np.asarray([slots, [s.num_prompt_tokens for s in seqs], lengths, batch_rows],
                                            dtype=np.int64).ravel(), fills.ravel(), known.ravel(), waiting.ravel()])
        # One transfer for all of it, and indexing by positions only: a boolean mask would make the host
        # wait for the device, which is still running the step's forward.
        dev = to_device(packed, self.device)
        slots_P, prompt_lens_P, lengths_P, rows_P = dev[:4 * P].view(4, P)
        fills, known, waiting = dev[4 * P:].split([2 * F, 3 * K, 3 * W])
        fills_2F, known_3K, waiting_3W = fills.view(2, F), known.view(3, K), waiting.view(3, W)
        if F:  # new slots first, then their tokens
            self.hist_SC[fills_2F[0]] = fills_2F[1][:, None]
        if K:
            self.hist_SC[known_3K[0], known_3K[1]] = known_3K[2]
        if W:
            row, slot, col = waiting_3W
            self.hist_SC[slot, col] = pending_values(pending, row, num_rows)
        self.last = (ids, list(batch_rows), rows_P, slots_P, prompt_lens_P, lengths_P, longest)
        return slots_P, prompt_lens_P, lengths_P, longest

    def moved_on(self, seqs: list[Sequence], pending, num_rows: int):
        """update() for the steady state of async decode: the last step's rows, each one PENDING token on. The
        tokens are written from the device and the lengths advance there: no host loop over the histories,
        no copy (a tenth of the host's per-step time with 256 penalised rows on the development CPU)."""
        ids, batch_rows, rows_P, slots_P, prompt_lens_P, lengths_P, longest = self.last
        for s in seqs:
            self.written[s.seq_id] += 1
        self.grow(longest + 1)
        self.hist_SC[slots_P, lengths_P] = pending_values(pending, rows_P, num_rows)
        lengths_P = lengths_P + 1  # a new tensor: the step in flight may still read the last one
        self.last = (ids, batch_rows, rows_P, slots_P, prompt_lens_P, lengths_P, longest + 1)
        return slots_P, prompt_lens_P, lengths_P, longest + 1


def pending_values(pending, rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The device values of the PENDING tokens of these step rows (each has one in the step in flight)."""
    assert pending is not None, "a PENDING token with no step in flight"
    fed_rows, values = pending
    if fed_rows is None:  # the leading rows, in order
        return values[rows]
    where = torch.zeros(num_rows, dtype=torch.int64, device=values.device)
    where[fed_rows] = torch.arange(len(fed_rows), device=values.device)
    return values[where[rows]]


class LogitsAdjuster:
    """The step's LogitsAdjust from its rows' parameters and histories; the histories stay on the device."""

    def __init__(self, vocab_size: int, device, max_num_seqs: int):
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self.histories = PenaltyHistories(max_num_seqs, device)
        self.last: tuple[list[Sequence] | None, tuple] = (None, ())
        self.last_update: tuple = ()  # the histories' last update: (slots, prompt lengths, lengths, longest)

    def __call__(self, seqs: list[Sequence], pending=None) -> LogitsAdjust | None:
        params = [s.params for s in seqs]
        if not any(p.adjusts_logits for p in params):
            return None
        if seqs != self.last[0]:  # what does not change while the batch stays: its biases and coefficients
            self.last = (list(seqs), self.fixed_parts(seqs))
        bias, penalised, coefficients, min_tokens = self.last[1]
        out = LogitsAdjust(banned=self.banned(seqs) if min_tokens else None, bias=bias)
        if penalised:
            group = [seqs[i] for i in penalised]
            self.last_update = self.histories.update(group, penalised, pending, len(seqs))
            self.penalties_into(out, coefficients, 0)
        return out

    def step_on(self, seqs: list[Sequence], sampled: torch.Tensor, k: int) -> LogitsAdjust:
        """Step k >= 1 of a multi-step decode of `seqs` (the batch of the last call): each penalised row's history
        gains the token step k - 1 sampled (`sampled`, on the device, written there), and min_tokens counts k
        more outputs than the host knows of."""
        bias, penalised, coefficients, min_tokens = self.last[1]
        out = LogitsAdjust(banned=self.banned(seqs, k) if min_tokens else None, bias=bias)
        if penalised:
            slots, _, lengths, longest = self.last_update
            self.histories.grow(longest + k)
            self.histories.hist_SC[slots, lengths + (k - 1)] = sampled[coefficients[0]]
            for i in penalised:  # the slot holds it now; the host's copy of the token comes after the pass
                self.histories.written[seqs[i].seq_id] += 1
            self.penalties_into(out, coefficients, k)
        return out

    def penalties_into(self, out: LogitsAdjust, coefficients, k: int) -> None:
        """The penalised rows' histories as of the last update, plus the k tokens multi-step wrote since."""
        slots, prompt_lens, lengths, longest = self.last_update
        # at least 2 columns (those past a history repeat its first token and are no output): a compiled sampler
        # would specialise a history of 1
        pos = torch.arange(max(longest + k, 2), device=self.device)
        out.rows, out.repetition, out.frequency, out.presence = coefficients
        out.tokens = self.histories.hist_SC[slots, :len(pos)]
        out.is_output = (pos >= prompt_lens[:, None]) & (pos < lengths[:, None] + k)

    def fixed_parts(self, seqs: list[Sequence]):
        """(logit_bias as (rows, ids, values), the penalised rows, their (rows, repetition, frequency,
        presence) on the device, whether a row has min_tokens)."""
        params = [s.params for s in seqs]
        bias = [(i, t, v) for i, p in enumerate(params) for t, v in (p.logit_bias or {}).items()]
        if bias:
            rows_ids = to_device(np.asarray([(i, t) for i, t, _ in bias], dtype=np.int64).T.copy(), self.device)
            bias = (rows_ids[0], rows_ids[1], to_device(np.asarray([v for *_, v in bias], dtype=np.float32), self.device))
        rows = [i for i, p in enumerate(params) if has_penalties(p)]
        min_tokens = any(p.min_tokens for p in params)
        if not rows:
            return bias or None, [], (), min_tokens
        c = to_device(np.asarray([(i, params[i].repetition_penalty, params[i].frequency_penalty,
                                   params[i].presence_penalty) for i in rows], dtype=np.float32).T.copy(), self.device)
        # (row numbers are exact in float32); each coefficient a tensor of its own, as the compiled penalties were
        # warmed up with (dynamo guards a view's storage offset of 0 or 1)
        return bias or None, rows, (c[0].long(), c[1].clone(), c[2].clone(), c[3].clone()), min_tokens

    def banned(self, seqs: list[Sequence], ahead: int = 0):
        """(rows, token ids) held back by min_tokens; `ahead`: outputs sampled that the host has not seen yet."""
        pairs = [(i, t) for i, s in enumerate(seqs) if s.num_output_tokens + ahead < s.params.min_tokens
                 for t in s.min_tokens_stops]
        return tuple(to_device(np.asarray(pairs, dtype=np.int64).T.copy(), self.device)) if pairs else None


def build_logits_adjust(seqs: list[Sequence], vocab_size: int, device, pending=None) -> LogitsAdjust | None:
    """One step's LogitsAdjust with fresh histories (what a step of a new batch gets)."""
    return LogitsAdjuster(vocab_size, device, max(len(seqs), 1))(seqs, pending)
