"""Shared pieces of the end-to-end benchmarks: engine flags, random prompts, timing, weight bytes."""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

# HBM bandwidth that the floors assume, by GPU: the H100 SXM's 3.0 TB/s of its spec sheet's 3.35 (DESIGN.md's
# floors); the H200's 4.3 of its 4.8 (a device-to-device copy, bytes read and written, on this workplace's H200s).
# Another GPU gets the H100's figure, and the printed floor names the figure it used.
HBM_BYTES_PER_S = {"H100": 3.0e12, "H200": 4.3e12}


def hbm_bytes_per_s() -> float:
    """The floor's bandwidth for this process's GPU (HBM_BYTES_PER_S; the H100's on anything else)."""
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return next((rate for gpu, rate in HBM_BYTES_PER_S.items() if gpu in name), HBM_BYTES_PER_S["H100"])


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The LLM(...) flags every end-to-end benchmark takes; None leaves the engine's default."""
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded tiny model)")
    p.add_argument("--dtype", default="auto", help="auto | bfloat16 | float16 | float32")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs, no compiled layers (FlexAttention stays compiled on a GPU)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="most requests in one step")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step (default 8192 on a GPU, 2048 on the CPU)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest request in tokens, prompt and output (default: the model's context, or what the "
                        "KV cache holds when that is less)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV pages (default: sized from memory)")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV cache page (default: 128 on a GPU with the flex backend, else 16)")
    p.add_argument("--attention-backend", default=None, help="flex | flash | reference | auto")
    p.add_argument("--num-scheduler-steps", type=int, default=None,
                   help="decode steps per schedule, fed on the device (CUDA graphs only; None: 1)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="launch each step before reading the last one's tokens back (default: on for a GPU unless "
                        "--num-scheduler-steps > 1, as LLM and `flexengine serve`; --no-async-scheduling turns it off)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                   help="ranks (GPUs, one process each) the model is sharded over (None: 1)")
    p.add_argument("--seed", type=int, default=0, help="engine seed and prompt seed")
    p.add_argument("--json-out", default=None, help="also write the results to this JSON file")


def engine_kwargs(args) -> dict:
    kwargs = dict(model=args.model, dtype=args.dtype, enforce_eager=args.enforce_eager, seed=args.seed,
                  async_scheduling=args.async_scheduling)
    optional = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                    num_kv_blocks=args.num_kv_blocks, attention_backend=args.attention_backend,
                    num_scheduler_steps=args.num_scheduler_steps, block_size=args.block_size,
                    max_model_len=args.max_model_len, tensor_parallel_size=args.tensor_parallel_size)
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    return kwargs


def engine_mode(llm) -> str:
    """How the engine runs its steps, for the report: "flex, graphs", "flex, eager", "flash, no graphs"."""
    runner = llm.llm_engine.runner
    if not runner.compiled:
        return f"{runner.backend.name}, eager"
    return f"{runner.backend.name}, {'graphs' if runner.decode_graphs is not None else 'no graphs'}"


def sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed(fn, *a, **kw):
    """(fn's result, wall seconds), with the GPU drained before and after."""
    sync()
    start = time.perf_counter()
    result = fn(*a, **kw)
    sync()
    return result, time.perf_counter() - start


def graph_us(fn, calls: int, repeats: int = 10) -> tuple[float, torch.cuda.CUDAGraph]:
    """(µs per call of fn(i), i = 0 .. calls - 1 captured in one CUDA graph: the median of `repeats` replays; the
    graph). The kernel-probe scripts' timer: launch gaps included, host dispatch not."""
    for i in range(calls):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[len(times) // 2], graph


def random_prompts(num: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Uniform random token ids: no tokenizer involved, and no two prompts share a KV page."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab_size, size=(num, input_len)).tolist()


def as_requests(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


def show_engine_info() -> None:
    """The engine's INFO lines (KV cache size, warm-up and capture times) to stderr, as vLLM's are, unless the
    caller set logging up itself."""
    import logging
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        logging.getLogger("flexengine").setLevel(logging.INFO)


def build_llm(args):
    """(LLM, seconds to construct it): load + whatever compile/capture the engine does up front, with the
    engine's INFO lines shown (show_engine_info)."""
    from flexengine import LLM
    show_engine_info()
    llm, seconds = timed(LLM, **engine_kwargs(args))
    if torch.cuda.is_available():
        print(f"GPU memory after start-up: {torch.cuda.memory_allocated() / 2 ** 30:.2f} GiB allocated, "
              f"{torch.cuda.memory_reserved() / 2 ** 30:.2f} GiB reserved, of "
              f"{torch.cuda.get_device_properties(0).total_memory / 2 ** 30:.2f} GiB", flush=True)
    return llm, seconds


def warm_up(llm, input_len: int, seed: int, num_prompts: int = 4, output_len: int = 4) -> float:
    """A tiny generate on prompts unlike the benchmark's (a different seed, so no prefix-cache hits later):
    lazy compiles and first-call costs land here, not in the timed run. Returns its seconds."""
    from flexengine import SamplingParams
    prompts = random_prompts(num_prompts, input_len, llm.llm_engine.vocab_size, seed + 10_007)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=1.0)
    return timed(llm.generate, as_requests(prompts), params, use_tqdm=False)[1]


def generate_fixed(llm, prompts: list[list[int]], output_len: int, temperature: float) -> float:
    """Generate exactly output_len tokens for every prompt; seconds. Fails loudly on a short output."""
    return generate_timed(llm, prompts, output_len, temperature)[0]


def generate_timed(llm, prompts: list[list[int]], output_len: int, temperature: float) -> tuple[float, list]:
    """generate_fixed, with the outputs: (seconds, RequestOutputs)."""
    from flexengine import SamplingParams
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=temperature)
    outputs, seconds = timed(llm.generate, as_requests(prompts), params, use_tqdm=False)
    check_lengths([len(o.outputs[0].token_ids) for o in outputs], len(prompts), output_len, "flexengine")
    return seconds, outputs


def ttft_summary(ttfts: list[float]) -> dict | None:
    """Median and 90th percentile of times to first token (seconds), or None without any."""
    if not ttfts:
        return None
    ordered = sorted(ttfts)
    return dict(median=statistics.median(ordered), p90=ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))])


def check_lengths(lengths: list[int], num: int, output_len: int, who: str) -> None:
    if len(lengths) != num:
        raise RuntimeError(f"{who}: {len(lengths)} outputs for {num} prompts")
    wrong = [n for n in lengths if n != output_len]
    if wrong:
        raise RuntimeError(f"{who}: {len(wrong)} of {num} outputs do not have {output_len} tokens "
                           f"(e.g. {wrong[0]}): the throughput would be wrong")


def compiled_graphs() -> int:
    from flexengine.compile import compile_count
    return compile_count()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter, each storage once (a tied embedding / lm_head counts once)."""
    seen, total = set(), 0
    for p in model.parameters():
        key = (p.untyped_storage().data_ptr(), p.storage_offset())
        if key not in seen:
            seen.add(key)
            total += p.numel() * p.element_size()
    return total


def engine_model(llm) -> torch.nn.Module:
    return llm.llm_engine.runner.model


def decode_ms_per_token(full_s: list[float], one_s: list[float], output_len: int) -> float:
    """(median time for output_len tokens - median time for 1) / (output_len - 1), in ms: prefill cancels."""
    return (statistics.median(full_s) - statistics.median(one_s)) / (output_len - 1) * 1e3


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def write_json(path: str | None, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
