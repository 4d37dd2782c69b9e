"""`flexengine generate PROMPT...`: generate text with the offline engine.

One prompt streams its text as it is generated; several show a progress bar, then each result.
--json prints one JSON object per prompt (a list) instead. --chat sends each prompt as a user message
through the model's chat template (or --chat-template FILE), as LLM.chat does.
"""
from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt text; several run as one batch")
    parser.add_argument("--model", default=None,
                        help="checkpoint directory or hub id (default: the embedded tiny model)")
    parser.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate per prompt")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature; 0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep this much probability mass")
    parser.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens (-1: all)")
    parser.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    parser.add_argument("--seed", type=int, default=None, help="per-request sampling seed (reproducible output)")
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeat for several)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of text")
    parser.add_argument("--chat", action="store_true",
                        help="send each prompt as a user message through the model's chat template")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="with --chat: a Jinja chat template file instead of the model's own")
    parser.add_argument("--dtype", default="auto", help="weights and KV dtype: auto, float32, bfloat16, float16")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    parser.add_argument("--attention-backend", default=None, choices=["flex", "flash", "reference", "auto"],
                        help="attention backend (default: FLEXENGINE_ATTENTION_BACKEND, else auto)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no CUDA graphs, no compiled layers (FlexAttention stays compiled on a GPU)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt + output per request (default: the model's context, or what the KV cache "
                             "holds when that is less)")
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache pages (default: sized from memory)")
    parser.add_argument("--block-size", type=int, default=None,
                        help="tokens per KV cache page (default: 128 on a GPU with the flex backend, else 16)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="token budget of one engine step, chunked prefill (default 8192 on a GPU, 2048 on the "
                             "CPU)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="fraction of GPU memory for weights, activations and KV cache")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="ranks (GPUs, one process each) the model is sharded over, Megatron-style; gloo "
                             "processes on the CPU")


def main(args: argparse.Namespace) -> int:
    from . import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop,
                            ignore_eos=args.ignore_eos)
    llm = LLM(args.model, dtype=args.dtype, device=args.device, attention_backend=args.attention_backend,
              enforce_eager=args.enforce_eager, max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks,
              block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
              gpu_memory_utilization=args.gpu_memory_utilization, tensor_parallel_size=args.tensor_parallel_size)
    prompts = args.prompts
    if args.chat or args.chat_template:
        prompts = chat_prompts(llm, prompts, args.chat_template)
    if args.json:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        print(json.dumps([{"prompt": o.prompt, "text": o.outputs[0].text, "token_ids": o.outputs[0].token_ids,
                           "finish_reason": o.outputs[0].finish_reason} for o in outputs], indent=2))
    elif len(prompts) == 1:
        stream(llm, prompts[0], params)
    else:
        for out in llm.generate(prompts, params, use_tqdm=True):
            print(f"--- {out.prompt!r}\n{out.outputs[0].text}")
    return 0


def chat_prompts(llm, texts: list[str], template_file: str | None) -> list[dict]:
    """Each text as a one-message conversation, through the chat template: {"prompt", "prompt_token_ids"}."""
    from .chat import chat_prompt_ids, read_chat_template
    template = read_chat_template(template_file, "generate")
    prompts = []
    for text in texts:
        try:
            templated, ids = chat_prompt_ids(llm.get_tokenizer(), [{"role": "user", "content": text}],
                                             chat_template=template)
        except ValueError as e:
            raise SystemExit(f"flexengine generate --chat: {e}")
        prompts.append({"prompt": templated, "prompt_token_ids": ids})
    return prompts


def stream(llm, prompt: str | dict, params) -> None:
    """Step the engine by hand and print each new piece of text as soon as it exists."""
    engine = llm.llm_engine
    engine.add_request("cli", prompt, params)
    shown = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown = len(text)
    sys.stdout.write("\n")
