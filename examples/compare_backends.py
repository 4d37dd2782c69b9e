"""The same prompts through each attention backend: flex (FlexAttention on the paged cache), flash
(FlashAttention, where a provider is installed and the masks allow it) and reference (dense math).

A backend that cannot serve the model says why (LLM raises ValueError); it is reported, not fatal.
The environment variable FLEXENGINE_ATTENTION_BACKEND picks the backend the same way for any script.
"""
import time

from flexengine import LLM, SamplingParams

prompts = ["Hello, my name is", "The capital of France is", "FlexAttention over a paged KV cache"]
params = SamplingParams(temperature=0, max_tokens=8)
tokens = {}
for backend in ("flex", "flash", "reference"):
    try:
        llm = LLM(attention_backend=backend)
    except ValueError as err:  # the documented "cannot serve this model" error: report its reason
        print(f"{backend:9s} unavailable: {err}")
        continue
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    tokens[backend] = [o.outputs[0].token_ids for o in outputs]
    print(f"{backend:9s} {time.perf_counter() - start:6.2f} s  first completion: {outputs[0].outputs[0].text!r}")

for backend, got in tokens.items():
    same = sum(a == b for a, b in zip(got, tokens["reference"]))
    print(f"{backend:9s} matches reference on {same}/{len(prompts)} prompts")
