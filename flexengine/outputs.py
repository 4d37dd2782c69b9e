"""What generate() returns, with vLLM's class and field names."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None            # 1 = most likely token
    decoded_token: str | None = None


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
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # per prompt token; None for the first
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
