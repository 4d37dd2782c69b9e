"""SamplingParams: vLLM's names and defaults, validated on construction (a bad value names its field)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .structured_outputs import StructuredOutputsParams  # noqa: F401 (vLLM has it here too)


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
    # vLLM's logits processors (layers/sampler.py applies them; logprobs stay those of the raw model):
    presence_penalty: float = 0.0     # subtracted from the logit of every token the output holds
    frequency_penalty: float = 0.0    # subtracted once per occurrence in the output
    repetition_penalty: float = 1.0   # a prompt or output token's logit: divided if > 0, else multiplied
    logit_bias: dict[int, float] | None = None  # token id → added to its logit
    min_tokens: int = 0               # no EOS, stop token or stop string before this many output tokens
    # json schema / regex / choice / grammar the output must match (engine/structured_outputs.py, xgrammar)
    structured_outputs: StructuredOutputsParams | None = None
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
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty < float("inf"):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                    _is_int(t) and t >= 0 and _is_number(v) and -100 <= v <= 100 for t, v in self.logit_bias.items()):
                raise ValueError(f"logit_bias must map token ids to numbers in [-100, 100], got {self.logit_bias!r}")
            self.logit_bias = {int(t): float(v) for t, v in self.logit_bias.items()} or None
        if not _is_int(self.min_tokens) or self.min_tokens < 0 or \
                (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams or None, got "
                             f"{type(self.structured_outputs).__name__}")
        if self.attention_params is not None and not isinstance(self.attention_params, dict):
            raise ValueError(f"attention_params must be a dict or None, got {type(self.attention_params).__name__}")
        if self.top_k == 0:
            self.top_k = -1  # one spelling for "disabled"

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def adjusts_logits(self) -> bool:
        """Whether its logits are changed before sampling from its own token history or biases."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1 or
                    self.logit_bias or self.min_tokens)

    def for_completion(self, index: int) -> "SamplingParams":
        """The params of completion `index` of n: each completion draws from its own seed (vLLM: seed + index)."""
        if self.seed is None or index == 0:
            return self
        return SamplingParams(**{**self.__dict__, "seed": self.seed + index})
