"""A sequence (one completion being generated) and a request (a prompt and its n sequences)."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np
import torch

from ..sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"    # not admitted, or preempted (its pages were freed; it will be recomputed)
    RUNNING = "running"    # holds pages; prefilling in chunks or decoding
    FINISHED = "finished"


_seq_ids = itertools.count()

# A token sampled on the device but not yet read back (async scheduling): it holds its place in
# token_ids, so scheduling and paging count it, and the next step reads its value on the device.
PENDING = -1
NO_ROW = -1  # Sequence.table_row of a sequence that holds no row of the block manager's BlockTables

# Getters for maps over a batch's sequences (a map with one runs in C, with no Python frame per sequence)
token_ids_of, num_computed_of = attrgetter("token_ids"), attrgetter("num_computed_tokens")
block_table_of, table_row_of = attrgetter("block_table"), attrgetter("table_row")


@dataclass(eq=False)
class Sequence:
    """Token ids (prompt then generated), how many of them have K/V in the cache, and the pages holding them."""
    request_id: str
    index: int                             # which of the request's n completions
    token_ids: list[int]                   # prompt + generated so far
    num_prompt_tokens: int
    params: SamplingParams
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    table_row: int = NO_ROW                # its row of the block manager's BlockTables while it holds pages
    num_computed_tokens: int = 0           # tokens whose K/V are in the cache
    num_cached_tokens: int = 0             # of those, how many came from the prefix cache at admission
    num_hashed_blocks: int = 0             # leading pages already walked by the prefix cache
    chain_hash: int | None = None          # prefix-cache hash of page num_hashed_blocks - 1
    chain_serial: int | None = None        # serial of the cached page holding that content (-1: chain broken)
    num_preemptions: int = 0
    generator: torch.Generator | None = None  # per-sequence RNG when params.seed is set
    detokenizer: object = None
    text: str = ""
    text_at_end: bool = False              # decode the text once when finished (no one reads it before)
    logprobs: list | None = None
    prompt_logprobs: list | None = None    # per prompt position: None (the first), then {token: Logprob}
    min_tokens_stops: frozenset = frozenset()  # tokens banned before params.min_tokens (EOS, stop ids)
    grammar: object = None                 # structured outputs: its GrammarState (engine/structured_outputs.py)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0               # output tokens and text characters already reported,
    num_sent_chars: int = 0                # for a request that reports deltas
    num_pending: int = 0                   # trailing token_ids that are PENDING
    prompt_array: np.ndarray | None = None  # the prompt's ids, int64, made at admission: a chunk's ids are a slice

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose values the host has: all but the trailing PENDING ones."""
        return len(self.token_ids) - self.num_pending

    def reaches_length_limit(self, num_tokens: int, max_model_len: int | None) -> bool:
        """Whether `num_tokens` tokens (prompt included) are all this sequence may have: its max_tokens
        outputs, or max_model_len."""
        limit = self.params.max_tokens
        return (limit is not None and num_tokens - self.num_prompt_tokens >= limit) or \
            (max_model_len is not None and num_tokens >= max_model_len)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id!r}.{self.index}, {self.status.value}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, pages={self.block_table})")


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    final_only: bool = False               # reported once, when finished
    delta: bool = False                    # each report carries only what is new since the last
    arrival_time: float = field(default_factory=time.time)  # RequestMetrics (vLLM's names), time.time()
    first_token_time: float | None = None  # when the step holding its first output token was read back

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens the prefix cache held for every completion."""
        if len(self.seqs) == 1:  # read for every streamed request at every step: skip the generator
            return self.seqs[0].num_cached_tokens
        return min(s.num_cached_tokens for s in self.seqs)

    @property
    def finished(self) -> bool:
        if len(self.seqs) == 1:  # checked for every request at every step: skip the generator
            return self.seqs[0].status is SequenceStatus.FINISHED
        return all(s.is_finished for s in self.seqs)
