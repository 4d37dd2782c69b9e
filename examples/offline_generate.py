"""Offline generation, vLLM-style: LLM(...).generate(prompts, SamplingParams(...)).

With no model argument the engine uses its embedded default model (a tiny random Llama with a byte
tokenizer, built offline on first use), so this runs on a CPU in seconds; its text is gibberish.
Pass a checkpoint directory instead, e.g. LLM("path/to/Llama-3.2-1B", dtype="bfloat16").
"""
from flexengine import LLM, SamplingParams

prompts = ["Hello, my name is", "The capital of France is", "FlexAttention over a paged KV cache"]
llm = LLM()
outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
for out in outputs:
    completion = out.outputs[0]
    print(f"{out.prompt!r} -> {completion.text!r} ({len(completion.token_ids)} tokens, {completion.finish_reason})")
print(f"generated {sum(len(o.outputs[0].token_ids) for o in outputs)} tokens for {len(outputs)} prompts")
