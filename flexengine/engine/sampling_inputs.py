"""The rows' sampling parameters on the device: temperature, top-p/k, min-p, logprobs, grammar masks and
logit adjustments (penalties, logit_bias), packed once per batch of sequences."""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ..attention.staging import to_device
from ..layers.sampler import SamplingTensors
from .in_flight import InFlightStep
from .logits_adjust import LogitsAdjuster
from .sequence import Sequence
from .structured_outputs import fill_token_mask


class SamplingInputs:
    def __init__(self, device: torch.device, vocab_size: int, max_num_seqs: int):
        self.device, self.vocab_size = device, vocab_size
        self.adjuster = LogitsAdjuster(vocab_size, device, max_num_seqs)
        self.last: tuple[list[Sequence] | None, SamplingTensors | None] = (None, None)

    def tensors(self, seqs: list[Sequence], prev: InFlightStep | None = None) -> SamplingTensors:
        """The rows' sampling parameters on the device; those of the last call when its sequences were
        the same (decode steps of an unchanged batch: no transfer). prev: the step in flight, whose
        samples are the rows' PENDING tokens (penalties count them)."""
        last_seqs, last = self.last
        if seqs == last_seqs:  # Sequence compares by identity
            tensors = last
        else:
            tensors = build_sampling_tensors(seqs, self.device)
            self.last = (list(seqs), tensors)
        if tensors.grammar_rows:  # their matchers moved on: new masks every step
            tensors = dataclasses.replace(tensors, token_mask=fill_token_mask(seqs, tensors.grammar_rows, self.device))
        if not tensors.adjusts_logits:  # (known since the rows were set: no per-step scan)
            return tensors
        pending = None if prev is None else prev.feed(seqs, None, self.device)  # (row i: sequence i)
        adjust = self.adjuster(seqs, pending)  # the histories grew: every step
        return tensors if adjust is None else dataclasses.replace(tensors, adjust=adjust)

    def step_on(self, tensors: SamplingTensors, seqs: list[Sequence], sampled: torch.Tensor, k: int) -> SamplingTensors:
        """The sampling inputs of step k >= 1 of a multi-step decode (`tensors`: step 0's, from tensors()):
        the logits processors see the tokens the steps before it sampled, on the device."""
        if not tensors.adjusts_logits:
            return tensors
        return dataclasses.replace(tensors, adjust=self.adjuster.step_on(seqs, sampled, k))


def build_sampling_tensors(seqs: list[Sequence], device: torch.device) -> SamplingTensors:
    params = [s.params for s in seqs]
    no_k = float(1 << 30)  # top_k "disabled": larger than any vocabulary
    rows = np.asarray([(p.temperature, p.top_p, p.min_p, p.top_k if p.top_k > 0 else no_k) for p in params],
                      dtype=np.float32).reshape(-1, 4)
    packed = to_device(rows, device)  # one transfer for all four
    any_top_k = any(p.top_k > 0 for p in params)
    any_top_p = any(p.top_p < 1 for p in params)
    any_min_p = any(p.min_p > 0 for p in params)
    asked = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingTensors(
        # (a contiguous tensor of its own, as the compiled sampler was warmed up with: the strided column compiled it
        # again, mid-run on the H100)
        temperature=packed[:, 0].clone(memory_format=torch.contiguous_format), top_p=packed[:, 1] if any_top_p else None,
        min_p=packed[:, 2] if any_min_p else None, top_k=packed[:, 3].long() if any_top_k else None,
        generators=tuple(s.generator for s in seqs), all_greedy=all(p.temperature == 0 for p in params),
        num_logprobs=max(asked) if asked else -1,
        grammar_rows=tuple(i for i, s in enumerate(seqs) if s.grammar is not None),
        adjusts_logits=any(p.adjusts_logits for p in params))
