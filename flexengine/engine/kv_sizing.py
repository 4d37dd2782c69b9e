"""How many KV pages the engine gets and how long a request may be: decided once, at start-up.

On a GPU the pool is what is left of `gpu_memory_utilization` x memory after a profiling step of the
full token budget (vLLM's rule); on the CPU, a fixed budget. Unasked, max_model_len is the model's whole
context, or what the pool holds when that is less (said in one warning).
"""
from __future__ import annotations

import contextlib
import gc
import logging

import torch

from ..attention.kv_cache import allocate_kv_cache, kv_cache_bytes
from ..config import CPU_KV_CACHE_BYTES, CPU_MAX_KV_TOKENS, DEFAULT_MAX_MODEL_LEN, MAX_KV_POOL_ELEMENTS, EngineConfig
from ..layers.sampler import SamplingTensors
from .scheduler import ScheduledBatch
from .sequence import Sequence

logger = logging.getLogger(__name__)


def text_config(hf_config):
    return hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config


def model_max_len(hf_config) -> int | None:
    return getattr(text_config(hf_config), "max_position_embeddings", None)


def wanted_max_model_len(config: EngineConfig, hf_config) -> int:
    """The asked-for length, else the model's whole context: max_model_len unless the cache holds less."""
    return config.max_model_len or model_max_len(hf_config) or DEFAULT_MAX_MODEL_LEN


def workspace_tokens_wanted(config: EngineConfig, hf_config) -> int:
    """The prefill workspace (attention/metadata.py): one request of the longest context and a full step
    beside it, and at least what a step of whole short prompts takes (each request's span rounded up
    to the alignment). Reserved before the pool is sized, so for the wanted length, not the one the
    pool allows."""
    from ..attention.layout import workspace_align
    a, budget = workspace_align(config.block_size), config.max_num_batched_tokens
    contexts = -(-wanted_max_model_len(config, hf_config) // a) * a + -(-budget // a) * a
    return max(contexts, a * (min(config.max_num_seqs, budget // 2) + -(-budget // a)))


def choose_max_model_len(config: EngineConfig, hf_config, num_blocks: int) -> int:
    """The asked-for length (checked against the model and the cache), else the model's, or the most
    the cache holds (vLLM's rule, except that vLLM fails where this says what it chose)."""
    P = config.block_size
    model_max, capacity = model_max_len(hf_config), num_blocks * P
    asked = config.max_model_len
    if asked is not None:
        if model_max is not None and asked > model_max:
            raise ValueError(f"max_model_len={asked} is larger than the model's max_position_embeddings "
                             f"({model_max})")
        need = -(-asked // P)
        if need > num_blocks:
            raise ValueError(f"the KV cache has {num_blocks} blocks of {P} tokens, too few for one request of "
                             f"max_model_len={asked}: it needs {need} blocks (raise num_kv_blocks or "
                             f"gpu_memory_utilization, or lower max_model_len)")
        return asked
    # Unasked, serve what both the model and the cache can hold, and say so when the cache decides.
    wanted = wanted_max_model_len(config, hf_config)
    if capacity < wanted:
        logger.warning("max_model_len is %d, what the KV cache holds (%d blocks of %d tokens); the model's own is "
                       "%s. Raise num_kv_blocks or gpu_memory_utilization (--num-kv-blocks, "
                       "--gpu-memory-utilization) for longer requests", capacity, num_blocks, P, model_max)
    return min(wanted, capacity)


def bytes_per_block(runner) -> int:
    elem = torch.empty((), dtype=runner.dtype).element_size()
    return 2 * len(runner.layers) * runner.block_size * runner.num_kv_heads * runner.head_dim * elem


def measure_num_blocks(runner) -> int:
    """CPU: a fixed budget (CPU_KV_CACHE_BYTES, at most CPU_MAX_KV_TOKENS tokens). GPU: what is left of
    gpu_memory_utilization x total memory after a profiling forward at max_num_batched_tokens."""
    per_block, cfg = bytes_per_block(runner), runner.config
    if runner.device.type != "cuda":
        return max(1, min(CPU_KV_CACHE_BYTES // per_block, CPU_MAX_KV_TOKENS // runner.block_size))
    budget = profile_kv_budget(runner)
    num = min(budget // per_block,
              MAX_KV_POOL_ELEMENTS // (runner.block_size * runner.num_kv_heads * runner.head_dim))
    if num < 1:
        raise ValueError(f"no GPU memory is left for the KV cache: the model and a step of "
                         f"{cfg.max_num_batched_tokens} tokens use more than gpu_memory_utilization="
                         f"{cfg.gpu_memory_utilization} of the device (raise it, or lower max_num_batched_tokens)")
    return int(num)


@torch.inference_mode()
def profile_kv_budget(runner) -> int:
    """Bytes for the KV cache: run the largest step the scheduler can make, on a scratch cache."""
    cfg, P, device = runner.config, runner.block_size, runner.device
    T = cfg.max_num_batched_tokens
    longest = min(n for n in (model_max_len(runner.hf_config), cfg.max_model_len, T) if n)  # positions it supports
    num_seqs = max(min(cfg.max_num_seqs, T), -(-T // longest))
    lens = [T // num_seqs + (i < T % num_seqs) for i in range(num_seqs)]
    scratch_blocks = sum(-(-n // P) for n in lens) + 1
    gc.collect()  # an engine the user dropped may sit in a reference cycle, holding its KV cache
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    scratch = allocate_kv_cache(len(runner.layers), scratch_blocks, P, runner.num_kv_heads, runner.head_dim,
                                runner.dtype, device)
    runner.attach_kv_cache(scratch)
    seqs, pages = [], iter(range(scratch_blocks))
    for n in lens:
        seq = Sequence(request_id="profile", index=0, token_ids=[0] * n, num_prompt_tokens=n, params=None)
        seq.block_table = [next(pages) for _ in range(-(-n // P))]
        seqs.append(seq)
    # flex's kernel is compiled for the real cache's shape by the warm-up; here it only allocates its output
    with getattr(runner.backend, "memory_stand_in", contextlib.nullcontext)():
        inputs = runner.prepare_step(ScheduledBatch(seqs, lens))
        hidden = runner.run_model(inputs.input_ids, inputs.positions, inputs.meta)
        logits = runner.model.compute_logits(hidden[inputs.sample_rows])
        runner.sampler(logits, SamplingTensors(temperature=torch.ones(len(seqs), device=device)))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - kv_cache_bytes(scratch)
    del scratch, hidden, logits, inputs
    runner.attach_kv_cache(None)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = (total - free) - torch.cuda.memory_reserved(device)  # CUDA context, other processes
    return int(total * cfg.gpu_memory_utilization - peak - outside_torch)
