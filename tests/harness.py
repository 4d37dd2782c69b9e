"""A minimal, test-only greedy loop over the paged KV cache (no scheduler, no engine).

Each request gets its own shuffled physical pages; every step packs the requests' new tokens,
builds the step's metadata once, and runs the model; a prefill (optionally in chunks) is followed
by one-token decode steps for all requests together.
"""
from __future__ import annotations

import contextlib
import os
import random

import torch

from flexengine.attention.backends import get_backend
from flexengine.attention.kv_cache import allocate_kv_cache
from flexengine.attention.metadata import build_metadata
from flexengine.attention.layout import plan_layout


class PagedRunner:
    """KV caches attached to a model's attention layers, plus each request's block table."""

    def __init__(self, model, num_requests: int, max_len: int, block_size: int, backend: str, seed: int = 0):
        self.model, self.block_size = model, block_size
        self.layers = model.attention_layers()
        first = self.layers[0]
        assert all((a.num_kv_heads, a.head_dim) == (first.num_kv_heads, first.head_dim) for a in self.layers)
        weight = next(model.parameters())
        self.device = weight.device
        pages = (max_len + block_size - 1) // block_size
        self.num_blocks = num_requests * pages + 3  # a few spare pages nobody owns
        cache = allocate_kv_cache(len(self.layers), self.num_blocks, block_size, first.num_kv_heads,
                                  first.head_dim, weight.dtype, self.device)
        for i, layer in enumerate(self.layers):
            layer.k_cache, layer.v_cache = cache[i]
        order = list(range(self.num_blocks))
        random.Random(seed).shuffle(order)  # physical order must not matter
        self.block_tables = torch.tensor([order[r * pages:(r + 1) * pages] for r in range(num_requests)],
                                         dtype=torch.int32, device=self.device)
        self.backend = get_backend(backend)
        self.mods = [(a.mask_mod, a.score_mod) for a in self.layers]

    @torch.inference_mode()
    def step(self, new_tokens: list[list[int]], starts: list[int], rows: list[int]) -> torch.Tensor:
        """Run requests `rows` with their new tokens at positions starts[i]...; → fp32 logits of each
        request's last new token [R, vocab]."""
        P = self.block_size
        query_lens = [len(t) for t in new_tokens]
        seq_lens = [s + n for s, n in zip(starts, query_lens)]
        ids = torch.tensor([t for toks in new_tokens for t in toks], dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, query_lens)]).to(self.device)
        tables = self.block_tables[rows]
        req = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(query_lens)).to(self.device)
        slots = tables[req, positions // P].long() * P + positions % P
        meta = build_metadata(tables, torch.tensor(seq_lens, dtype=torch.int32, device=self.device), slots,
                              plan_layout(query_lens, seq_lens, block_size=P), P, self.num_blocks)
        meta.backend = self.backend
        self.backend.prepare(meta, self.mods)
        self.last_meta = meta  # for tests that inspect what the step built
        hidden = self.model(ids, positions, meta)
        last = torch.tensor(query_lens, device=self.device).cumsum(0) - 1
        return self.model.compute_logits(hidden[last])


def greedy_generate(model, prompt_ids, max_new_tokens: int, block_size: int = 16, backend: str = "flex",
                    prefill_chunk: int | None = None, seed: int = 0):
    """Greedy decoding → (token_ids, chosen_logprobs).

    `prompt_ids` is one prompt (list of ints) or several (list of lists, run as one batch); the result
    has the same nesting. `prefill_chunk` splits each prompt's prefill into steps of that many tokens.
    """
    single = bool(prompt_ids) and isinstance(prompt_ids[0], int)
    prompts = [list(prompt_ids)] if single else [list(p) for p in prompt_ids]
    assert all(prompts), "empty prompt"
    max_len = max(len(p) for p in prompts) + max_new_tokens
    runner = PagedRunner(model, len(prompts), max_len, block_size, backend, seed)
    R = len(prompts)
    chunk = prefill_chunk or max(len(p) for p in prompts)
    done = [0] * R
    logits = [None] * R
    while any(d < len(p) for d, p in zip(done, prompts)):  # prefill, all requests in each step
        rows = [r for r in range(R) if done[r] < len(prompts[r])]
        new = [prompts[r][done[r]:done[r] + chunk] for r in rows]
        out = runner.step(new, [done[r] for r in rows], rows)
        for i, r in enumerate(rows):
            done[r] += len(new[i])
            logits[r] = out[i]
    tokens, logprobs = [[] for _ in range(R)], [[] for _ in range(R)]
    lengths = [len(p) for p in prompts]
    for step in range(max_new_tokens):
        last = torch.stack(logits).log_softmax(-1)
        chosen = last.argmax(-1)
        for r in range(R):
            tokens[r].append(int(chosen[r]))
            logprobs[r].append(float(last[r, chosen[r]]))
        if step == max_new_tokens - 1:
            break
        out = runner.step([[t[-1]] for t in tokens], lengths, list(range(R)))
        lengths = [n + 1 for n in lengths]
        logits = list(out)
    return (tokens[0], logprobs[0]) if single else (tokens, logprobs)


@contextlib.contextmanager
def flex_prefill(kernel: str):
    """FLEXENGINE_FLEX_PREFILL for the flex backends made inside (paged_attention's shared one decides at
    its first call; this makes a fresh decision)."""
    from flexengine.attention.backends import default_flex
    from flexengine.config import FLEX_PREFILL_ENV
    before = os.environ.get(FLEX_PREFILL_ENV)
    os.environ[FLEX_PREFILL_ENV] = kernel
    default_flex.cache_clear()
    try:
        yield
    finally:
        os.environ.pop(FLEX_PREFILL_ENV) if before is None else os.environ.__setitem__(FLEX_PREFILL_ENV, before)
        default_flex.cache_clear()


def fa4_reason():
    """Why FA4 cannot serve flex's prefill here, or None."""
    from flexengine.attention.backends.prefill_kernel import fa4_unsupported_reason
    if not torch.cuda.is_available():
        return "needs CUDA"
    return fa4_unsupported_reason(torch.device("cuda"), torch.bfloat16, 64)


def decode_graph_helpers() -> dict:
    """The helpers the CUDA engine's decode graphs compile (compile.compiled_on_first_use), by name: (module whose
    plain function the CPU's call sites take, the compiled version's maker). tests/test_cuda_graphs.py and
    scripts/cpu_inductor_helpers.py swap them in on the CPU."""
    from flexengine.attention.backends import paged_mods
    from flexengine.compile import cuda_graphs
    return {"take_decode_inputs": (cuda_graphs, cuda_graphs._compiled_take_decode_inputs),
            "decode_lists": (paged_mods, paged_mods._compiled_decode_lists)}
