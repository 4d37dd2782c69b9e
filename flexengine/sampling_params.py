"""SamplingParams: vLLM's names and defaults, validated on construction (a bad value names its field)."""
from __future__ import annotations

from dataclasses import dataclass, field


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0          # 0 → greedy
    top_p: float = 1.0
    top_k: int = -1                   # -1 or 0 → disabled (vLLM)
    min_p: float = 0.0
    seed: int | None = None           # per-request RNG, independent of the rest of the batch
    max_tokens: int | None = 16       # None → until max_model_len
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None       # top-k logprobs per generated token (the chosen one always included)
    prompt_logprobs: int | None = None  # the same per prompt token (engine/prompt_logprobs.py)
    attention_params: dict | None = field(default=None)  # per-request mask/score parameters

    def __post_init__(self):
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if not _is_number(self.temperature) or not self.temperature >= 0 or self.temperature == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled), 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs must be an integer >= 0 or None, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs) or self.prompt_logprobs < 0):
            raise ValueError(f"prompt_logprobs must be an integer >= 0 or None, got {self.prompt_logprobs!r}")
        if self.attention_params is not None and not isinstance(self.attention_params, dict):
            raise ValueError(f"attention_params must be a dict or None, got {type(self.attention_params).__name__}")
        if self.top_k == 0:
            self.top_k = -1  # one spelling for "disabled"

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def for_completion(self, index: int) -> "SamplingParams":
        """The params of completion `index` of n: each completion draws from its own seed (vLLM: seed + index)."""
        if self.seed is None or index == 0:
            return self
        return SamplingParams(**{**self.__dict__, "seed": self.seed + index})
