"""What generate() returns, with vLLM's class and field names."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None            # 1 = most likely token
    decoded_token: str | None = None


def logprob_entries(token: int, chosen: float, rank: int, top_ids, top_logprobs, text_of) -> dict[int, Logprob]:
    """vLLM's logprobs of one position: the top tokens with ranks 1, 2, ..., and `token` with its own logprob
    and rank (a top token keeps the rank the sampler counted, which differs on ties)."""
    entries = {t: Logprob(v, r, text_of(t)) for r, (t, v) in enumerate(zip(top_ids, top_logprobs), start=1)}
    if token in entries:
        entries[token].rank = rank
    else:
        entries[token] = Logprob(chosen, rank, text_of(token))
    return entries


class FlatLogprobs(Sequence):
    """A prompt's logprobs as vLLM gives them, `list[dict[int, Logprob] | None]` (None for the first position,
    then the prompt token and the top k), kept as arrays and made into a dict when a position is read.

    A loglikelihood request scores every prompt token, and a dict with one or two Logprob objects per
    position cost about 6 µs of the host's time (a 1,000 × 256 request batch: 1.5 s, longer than the GPU's
    prefill of it); lm-eval then reads only the continuation's few positions. vLLM keeps its logprobs flat
    for the same reason (`FlatLogprobs` in vllm/logprobs.py, to spare the garbage collector)."""

    def __init__(self, token_ids: list[int], k: int, text_of: Callable[[int], str | None] | dict):
        n = len(token_ids)
        self.token_ids, self.k = np.asarray(token_ids, dtype=np.int64), k
        self.logprob = np.zeros(n, np.float32)    # of the prompt token at each position
        self.rank = np.zeros(n, np.int64)         # its rank (1 = most likely); 0: not scored yet
        self.top_ids = np.zeros((n, k), np.int64)
        self.top_logprobs = np.zeros((n, k), np.float32)
        self.text_of = text_of                    # a token's text alone (dict after pickling)

    def fill(self, first: int, logprob, rank, top_ids, top_logprobs) -> None:
        """Positions first .. first + len(logprob) - 1 (a position scored again gets the same values)."""
        at = slice(first, first + len(logprob))
        self.logprob[at], self.rank[at] = logprob, rank
        self.top_ids[at], self.top_logprobs[at] = top_ids[:, :self.k], top_logprobs[:, :self.k]

    def __len__(self) -> int:
        return len(self.token_ids)

    def __iter__(self):
        return iter(self.positions(range(len(self))))

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.positions(range(*i.indices(len(self))))
        return self.positions([range(len(self))[i]])[0]

    def positions(self, at) -> list[dict[int, Logprob] | None]:
        """The dicts of these positions, from lists made once (numpy scalars one at a time cost 3× as much)."""
        at = list(at)
        text = self.text_of.get if isinstance(self.text_of, dict) else self.text_of
        columns = (self.token_ids[at].tolist(), self.logprob[at].tolist(), self.rank[at].tolist(),
                   self.top_ids[at].tolist(), self.top_logprobs[at].tolist())
        # (None for the first position, and for one not scored yet)
        return [None if i == 0 or rank == 0 else logprob_entries(token, chosen, rank, ids, lps, text)
                for i, token, chosen, rank, ids, lps in zip(at, *columns)]

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"FlatLogprobs({list(self)!r})"

    def __getstate__(self) -> dict:
        """Pickled (to the server's API process) with the texts of its own tokens, not the tokenizer."""
        state = dict(self.__dict__)
        if not isinstance(self.text_of, dict):
            ids = np.unique(np.concatenate([self.token_ids, self.top_ids.ravel()])).tolist()
            state["text_of"] = {t: self.text_of(t) for t in ids}
        return state


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # per generated token; includes the chosen one
    finish_reason: str | None = None   # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """vLLM's names; time.time() seconds. first_token_time: when the step that made the request's
    first output token was read back (time to first token = first_token_time - arrival_time)."""
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: FlatLogprobs | None = None  # reads as list[dict[int, Logprob] | None]; None for the first token
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None


class CompletionDelta(NamedTuple):
    """What one completion of a streamed request (added with delta=True) gained in one step, as
    LLMEngine.step_deltas returns it. A tuple: it pickles in a third of a dataclass's time."""
    request_id: str
    index: int
    text: str                    # appended to the text (the visible text never shrinks)
    token_ids: list[int]         # new token ids
    logprobs: list | None        # one dict per new token, when asked for
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: int | str | None
    num_cached_tokens: int
    prompt_logprobs: list | None = None  # the request's (RequestOutput.prompt_logprobs), on its first rows
