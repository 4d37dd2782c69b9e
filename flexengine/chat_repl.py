"""`flexengine chat`: talk to a model in the terminal.

Each line you type is a user message; the reply streams as it is generated, and the whole conversation
goes through the model's chat template (or --chat-template FILE) on every turn. Ctrl-D (end of input)
quits; Ctrl-C stops a reply midway (or clears the line you are typing); /clear starts a new conversation.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys

PROMPT = ">>> "
DEFAULT_TEMPERATURE = 0.7  # without flags or a generation_config.json: less rambling than vLLM's 1.0
HELP = "Type a message and press Enter. Ctrl-D quits, Ctrl-C stops a reply, /clear starts over."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[1].replace("\n", " ")
    parser.add_argument("--model", default=None,
                        help="checkpoint directory, GGUF file, hub id or named model such as smollm2-135m-instruct "
                             "(fetched once); default: the embedded tiny random model, which writes gibberish")
    parser.add_argument("--system", default=None, help="a system message that starts the conversation")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="a Jinja chat template file instead of the model's own")
    parser.add_argument("--max-tokens", type=int, default=512, help="most tokens per reply")
    parser.add_argument("--temperature", type=float, default=None,
                        help="sampling temperature; 0 is greedy (default: the checkpoint's generation_config.json, "
                             f"else {DEFAULT_TEMPERATURE})")
    parser.add_argument("--top-p", type=float, default=None,
                        help="nucleus sampling: keep this much probability mass (default: generation_config.json, "
                             "else 1)")
    parser.add_argument("--top-k", type=int, default=None,
                        help="keep the k most likely tokens (default: generation_config.json, else all)")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (the same replies each run)")
    parser.add_argument("--dtype", default="auto", help="weights and KV dtype: auto, float32, bfloat16, float16")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest conversation + reply in tokens (default: the model's context, or what the KV "
                             "cache holds when that is less)")
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache pages (default: sized from memory)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs, no compiled layers")


def main(args: argparse.Namespace) -> int:
    from . import LLM
    from .chat import read_chat_template

    template = read_chat_template(args.chat_template, "chat")
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
              num_kv_blocks=args.num_kv_blocks, enforce_eager=args.enforce_eager)
    params = sampling_params(llm, args)
    if args.model is None:
        print("(the embedded random model: its replies are gibberish; --model smollm2-135m-instruct is a real one)")
    print(HELP)
    start = [{"role": "system", "content": args.system}] if args.system else []
    conversation = list(start)
    turns = itertools.count()
    while True:
        try:
            line = input(PROMPT)
        except EOFError:  # Ctrl-D
            print()
            return 0
        except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh line, as a shell does
            print()
            continue
        if line.strip() == "/clear":
            conversation = list(start)
            print("(new conversation)")
            continue
        if not line.strip():
            continue
        conversation.append({"role": "user", "content": line})
        try:
            reply = stream_reply(llm, conversation, params, template, f"chat-{next(turns)}")
        except ValueError as e:  # e.g. the conversation no longer fits: say so, keep the loop
            print(f"error: {e}")
            conversation.pop()
            continue
        conversation.append({"role": "assistant", "content": reply})


def sampling_params(llm, args):
    """The flags given, else the checkpoint's generation_config.json, else the chat defaults."""
    from . import SamplingParams
    from .llm import generation_config_defaults

    fields = {"temperature": DEFAULT_TEMPERATURE, **generation_config_defaults(llm.llm_engine.runner.model_path)}
    given = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    fields.update({k: v for k, v in given.items() if v is not None})
    fields.update(max_tokens=args.max_tokens, seed=args.seed)
    return SamplingParams(**fields)


def stream_reply(llm, conversation: list[dict], params, template: str | None, request_id: str) -> str:
    """Generate the assistant's next message, writing each piece of text as soon as it exists."""
    from .chat import chat_prompt_ids

    engine = llm.llm_engine
    text, ids = chat_prompt_ids(llm.get_tokenizer(), conversation, chat_template=template)
    room = engine.max_model_len - len(ids)
    if room < 1:
        raise ValueError(f"the conversation is {len(ids)} tokens, the model's limit is {engine.max_model_len}: "
                         f"/clear starts a new one")
    params = dataclasses.replace(params, max_tokens=min(params.max_tokens, room))
    engine.add_request(request_id, {"prompt": text, "prompt_token_ids": ids}, params, delta=True)
    pieces = []
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                pieces.append(out.outputs[0].text)
                sys.stdout.write(pieces[-1])
                sys.stdout.flush()
    except KeyboardInterrupt:  # Ctrl-C: keep what was said so far
        engine.abort_request(request_id)
        pieces.append(" [stopped]")
        sys.stdout.write(pieces[-1])
    sys.stdout.write("\n")
    return "".join(pieces).removesuffix(" [stopped]")
