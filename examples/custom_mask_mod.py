"""StreamingLLM-style attention: every query sees 4 "sink" tokens plus a sliding window of recent ones.

The mask is a plain function of logical positions, registered by name; the engine runs it on the
paged KV cache in every layer. The dense reference backend (attention_backend="reference") evaluates
the same mask over each request's gathered K/V, so the two must pick the same greedy tokens.
"""
import sys

from flexengine import LLM, SamplingParams
from flexengine.masks import register_mask_mod

SINKS, WINDOW = 4, 16


@register_mask_mod("sink_window")
def sink_window(b, h, q_idx, kv_idx):
    causal = kv_idx <= q_idx
    return causal & ((kv_idx < SINKS) | (q_idx - kv_idx < WINDOW))


sink_window.causal_safe = True  # never looks ahead: the prefix cache may share its pages

prompt = "Attention sinks keep the first tokens visible while the window slides over the rest of the text."
params = SamplingParams(temperature=0, max_tokens=12)


def generate(**kwargs) -> list[int]:
    return LLM(**kwargs).generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


flex = generate(mask_mod="sink_window")
reference = generate(mask_mod="sink_window", attention_backend="reference")
causal = generate()
print(f"sink_window ({SINKS} sinks + window {WINDOW}), flex:      {flex}")
print(f"sink_window ({SINKS} sinks + window {WINDOW}), reference: {reference}")
print(f"plain causal attention:                   {causal}")
if flex != reference:
    sys.exit("FAILED: flex and the dense reference picked different tokens")
print("flex == dense reference: same greedy tokens")
print(f"differs from plain causal attention: {flex != causal}")
