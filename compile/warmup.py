"""Start-up warm-up: run dummy steps of each shape class so every compile happens before a request.

FlexAttention is compiled with automatic dynamic shapes: the first call specialises, the first call
with a different size recompiles that dimension as symbolic, and later sizes reuse it. Three mixed
steps of different sizes therefore settle both call sites (decode rows and prefill tiles).
"""
from __future__ import annotations

import time

import torch


def warm_up_steps(runner, sizes=((300, 2), (40, 3), (150, 0))) -> float:
    """Run (prefill tokens, decode requests) dummy steps on pages no request owns yet; seconds taken."""
    from ..engine.scheduler import ScheduledBatch
    from ..engine.sequence import Sequence
    P = runner.block_size
    start = time.perf_counter()
    for prefill_len, num_decode in sizes:
        prefill_len = min(prefill_len, runner.max_model_len, runner.config.max_num_batched_tokens - num_decode)
        seqs, new, page = [], [], 0
        for n, computed in [(prefill_len, 0)] + [(min(9, runner.max_model_len), min(8, runner.max_model_len - 1))] * num_decode:
            pages = -(-n // P)
            if page + pages > runner.num_blocks:
                break
            seq = Sequence(request_id="warmup", index=0, token_ids=[0] * n, num_prompt_tokens=n, params=None)
            seq.block_table, seq.num_computed_tokens = list(range(page, page + pages)), computed
            page += pages
            seqs.append(seq)
            new.append(n - computed)
        with torch.inference_mode():
            inputs = runner.prepare_step(ScheduledBatch(seqs, new), sampling=False)
            runner.forward_logits(inputs.input_ids, inputs.positions, inputs.meta)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return time.perf_counter() - start
