"""Requests in: a prompt becomes token ids, and every input is checked before anything is allocated.

A bad request raises ValueError naming the problem and leaves the engine exactly as it was (LLMEngine.add_request
calls these first).
"""
from __future__ import annotations

import math

from ..sampling_params import SamplingParams


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, max_num_batched_tokens: int,
                 look_ahead: str | None, block_manager, mod_params: dict):
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.look_ahead = look_ahead  # why a prompt must be computed in one step (a mask that looks ahead), or None
        self.block_manager = block_manager
        self.mod_params = mod_params  # {name: its dtype and the mod reading it}

    def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        """A str, {"prompt_token_ids": [...]} (optionally with "prompt") or a list of ids → (text, ids)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass the prompt as {'prompt_token_ids': [...]}")
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError(f"a prompt dict needs 'prompt_token_ids', got keys {sorted(prompt)}")
            text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, prompt
        else:
            raise ValueError(f"a prompt must be a str or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
        # the types' set in C: a generator over every id of a 65,536-token prompt took milliseconds
        if not isinstance(ids, (list, tuple)) or not set(map(type, ids)) <= {int}:  # (a bool's type is bool)
            raise ValueError("prompt_token_ids must be a list of integers")
        return text, list(ids)

    def validate(self, prompt_ids: list[int], params) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if not prompt_ids:
            raise ValueError("the prompt is empty: it needs at least one token")
        if not 0 <= min(prompt_ids) <= max(prompt_ids) < self.vocab_size:  # the loop only to name the first
            bad = next(t for t in prompt_ids if not 0 <= t < self.vocab_size)
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if len(prompt_ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens, more than max_model_len={self.max_model_len}")
        if self.look_ahead and len(prompt_ids) > self.max_num_batched_tokens:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens, more than max_num_batched_tokens="
                             f"{self.max_num_batched_tokens}; it must be computed in one step because "
                             f"{self.look_ahead}, so raise max_num_batched_tokens")
        if self.block_manager.blocks_for(len(prompt_ids)) > self.block_manager.num_blocks:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens, more than the KV cache can ever hold "
                             f"({self.block_manager.num_blocks} blocks of {self.block_manager.block_size})")
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids: {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model has none (use stop_token_ids)")
        bad = [t for t in (params.logit_bias or {}) if t >= self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.vocab_size:
                raise ValueError(f"{name}={k} is more than the vocabulary size {self.vocab_size}")
        self.validate_attention_params(params.attention_params or {})

    def validate_attention_params(self, given: dict) -> None:
        """Every parameter the layers' mods read, as a number of its declared dtype; a key no mod reads is a
        mistake (a typo would otherwise leave the mod reading 0)."""
        read = self.mod_params
        for name, value in given.items():
            if name not in read:
                raise ValueError(f"attention_params key {name!r} is read by no mod of this model "
                                 f"(they read: {', '.join(map(repr, read)) or 'nothing'})")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
                    (isinstance(value, int) and not -2 ** 63 <= value < 2 ** 63):
                raise ValueError(f"attention_params[{name!r}] must be a finite int (int64) or float, got {value!r}")
            if isinstance(value, float) and not read[name].dtype.is_floating_point:  # an int for a float converts
                raise ValueError(f"attention_params[{name!r}] is {value!r}, a float, but mod {read[name].mod} reads "
                                 f"{name!r} as int64; annotate it `{name}: float` in the mod to read floats")
        for name, param in read.items():
            if name not in given:
                raise ValueError(f"mod {param.mod} reads the per-request parameter {name!r}: pass "
                                 f"SamplingParams(attention_params={{{name!r}: ...}})")
