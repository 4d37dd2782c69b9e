"""Prompt logprobs (vLLM's `SamplingParams(prompt_logprobs=k)`): the logprob of each prompt token given
the ones before it, with its rank and the top k, taken from the hidden states the prefill computes
anyway. Only the first completion of a request that asks pays for it, and it takes no prefix-cache
hits (a cached page has no hidden states to score). Logits are made a slice of rows at a time: a
2,048-token chunk over a 128k vocabulary would otherwise hold a gigabyte of them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..attention.staging import to_device
from ..layers.sampler import compute_logprobs
from .sequence import Sequence

ROWS_PER_SLICE = 1024  # 256 MB of bf16 logits at a 128k vocabulary; 256 made 4x the launches


def wants_prompt_logprobs(seq: Sequence) -> bool:
    return seq.index == 0 and seq.params is not None and seq.params.prompt_logprobs is not None


@dataclass
class PromptLogprobs:
    """One step's prompt-token logprobs, on the device until read back."""
    spans: list[tuple[Sequence, int, int]]  # (sequence, first prompt position scored, how many)
    chosen: torch.Tensor                    # float32 [M]: logprob of each scored prompt token
    rank: torch.Tensor                      # int64 [M]: its rank (1 = most likely)
    top_ids: torch.Tensor                   # int64 [M, K]
    top_logprobs: torch.Tensor              # float32 [M, K]

    def tensors(self) -> list[torch.Tensor]:
        return [self.chosen, self.rank, self.top_ids, self.top_logprobs]


def score_prompt_tokens(compute_logits, hidden: torch.Tensor, seqs: list[Sequence], num_new: list[int],
                        first_rows: np.ndarray, compiled: bool = False) -> PromptLogprobs | None:
    """For the sequences that ask: the row of position p (packed at first_rows[i] + p - computed) scores
    prompt token p + 1. `computed` is each sequence's count before this step. None when none asks."""
    spans, rows, targets = [], [], []
    for seq, n, row0 in zip(seqs, num_new, first_rows):
        if not wants_prompt_logprobs(seq):
            continue
        start = seq.num_computed_tokens  # not yet advanced: the engine marks the step launched after this
        stop = min(start + n, seq.num_prompt_tokens - 1)  # the last prompt row scores the first output
        if stop <= start:
            continue
        spans.append((seq, start + 1, stop - start))
        rows.append(np.arange(row0, row0 + stop - start))
        targets.extend(seq.token_ids[start + 1:stop + 1])
    if not spans:
        return None
    k = max(seq.params.prompt_logprobs for seq, _, _ in spans)
    # One pinned, non-blocking copy: a plain .to(device) would wait for the forward queued before it.
    rows_t, targets_t = to_device(np.concatenate(rows + [np.asarray(targets, dtype=np.int64)]),
                                  hidden.device).view(2, -1)
    parts = []
    for at in range(0, len(targets), ROWS_PER_SLICE):
        logits = compute_logits(hidden[rows_t[at:at + ROWS_PER_SLICE]], float32=False)  # scored in float32
        parts.append(compute_logprobs(logits, targets_t[at:at + ROWS_PER_SLICE], k, compiled))  # the sampler's rule
    return PromptLogprobs(spans, *(torch.cat(p) for p in zip(*parts)))
