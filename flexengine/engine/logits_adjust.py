"""One step's logits processors (penalties, logit_bias, min_tokens) from its sequences' histories:
host lists → the device tensors of layers/sampler.LogitsAdjust. Built every step for the rows that ask
(their history grows). With async scheduling a row's last token may still be PENDING on the host: its
value is on the device (the step in flight sampled it), and it is counted there.
"""
from __future__ import annotations

import numpy as np
import torch

from ..attention.metadata import to_device
from ..layers.sampler import LogitsAdjust
from .sequence import PENDING, Sequence


def build_logits_adjust(seqs: list[Sequence], vocab_size: int, device,
                        pending: tuple[torch.Tensor | None, torch.Tensor] | None = None) -> LogitsAdjust | None:
    """pending: (rows, token ids) on the device of the rows' PENDING tokens (InFlightStep.feed; rows None:
    the leading rows in order), or None."""
    params = [s.params for s in seqs]
    if not any(p.adjusts_logits for p in params):
        return None
    N = len(seqs)
    banned = [(i, t) for i, s in enumerate(seqs) if s.num_output_tokens < s.params.min_tokens
              for t in s.min_tokens_stops]
    bias = [(i, t, v) for i, p in enumerate(params) for t, v in (p.logit_bias or {}).items()]
    out = LogitsAdjust(
        banned=tuple(to_device(np.asarray(banned, dtype=np.int64).T.copy(), device)) if banned else None,
        bias=None)
    if bias:
        rows_ids = to_device(np.asarray([(i, t) for i, t, _ in bias], dtype=np.int64).T.copy(), device)
        out.bias = (rows_ids[0], rows_ids[1], to_device(np.asarray([v for *_, v in bias], dtype=np.float32), device))
    if any(p.repetition_penalty != 1 for p in params):
        out.repetition = to_device(np.asarray([p.repetition_penalty for p in params], dtype=np.float32), device)
        out.seen = torch.zeros(N, vocab_size, dtype=torch.bool, device=device)
        rows, ids = history(seqs, [p.repetition_penalty != 1 for p in params], output_only=False)
        out.seen[to_device(rows, device), to_device(ids, device)] = True
        if pending is not None:
            out.seen[pending_index(pending)] = True
    if any(p.frequency_penalty or p.presence_penalty for p in params):
        out.frequency = to_device(np.asarray([p.frequency_penalty for p in params], dtype=np.float32), device)
        out.presence = to_device(np.asarray([p.presence_penalty for p in params], dtype=np.float32), device)
        out.counts = torch.zeros(N, vocab_size, dtype=torch.float32, device=device)
        rows, ids = history(seqs, [bool(p.frequency_penalty or p.presence_penalty) for p in params], output_only=True)
        out.counts.index_put_((to_device(rows, device), to_device(ids, device)),
                              torch.ones(len(rows), device=device), accumulate=True)
        if pending is not None:  # rows that did not ask have zero penalties: counting theirs is harmless
            index = pending_index(pending)
            out.counts.index_put_(index, torch.ones(len(index[1]), device=device), accumulate=True)
    return out


def pending_index(pending: tuple[torch.Tensor | None, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    rows, ids = pending
    if rows is None:
        rows = torch.arange(len(ids), device=ids.device)
    return rows, ids


def history(seqs: list[Sequence], wanted: list[bool], output_only: bool) -> tuple[np.ndarray, np.ndarray]:
    """(row, token id) of every known token of the wanted rows: their output, or prompt and output."""
    parts = [(i, s.token_ids[s.num_prompt_tokens if output_only else 0:]) for i, (s, w) in enumerate(zip(seqs, wanted))
             if w]
    rows = np.concatenate([np.full(len(t), i, np.int64) for i, t in parts] or [np.zeros(0, np.int64)])
    ids = np.concatenate([np.asarray(t, np.int64) for _, t in parts] or [np.zeros(0, np.int64)])
    known = ids != PENDING  # a pending token is counted on the device (build_logits_adjust)
    return rows[known], ids[known]
