"""attention-gym's mods (pip install attn-gym), served unchanged on the paged KV cache.

1. A Longformer mask (global tokens + a window) and a Sandwich position bias. Both index tensors they
   capture: the mask a [max_model_len] table by position, the bias a relative-distance table and a
   per-head one. The engine calls mods only on real positions and heads, so tables of max_model_len
   entries and num_heads entries are enough. The gym's mask is bidirectional, so a decoder composes it
   with causal. The dense reference backend must pick the same greedy tokens.
2. The gym's prefix-LM captures one prefix length for the whole batch. In an engine each request has
   its own: the same mask with the length as a per-request parameter gives, batched, what the gym's
   mask gives each request alone.
"""
import sys

import torch
from attn_gym.masks import generate_global_sliding_window, generate_prefix_lm_mask
from attn_gym.mods import generate_sandwich_bias

from flexengine import LLM, SamplingParams, masks
from flexengine.models import default_model

MAX_LEN = 256                                         # max_model_len: what captured position tables must hold
HEADS = default_model.CONFIG["num_attention_heads"]  # the model's query heads: what per-head tables must hold
greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
prompts = ["Global tokens see everything and everything sees them.", "A short one."]

# 1. Longformer + Sandwich
is_global = torch.zeros(MAX_LEN, dtype=torch.bool)
is_global[0] = True  # the first token is global, as a [CLS] would be
longformer = masks.and_masks("causal", generate_global_sliding_window(8, is_global))
sandwich = generate_sandwich_bias(HEADS, MAX_LEN)


def generate(prompts, params=greedy, **kwargs) -> list[list[int]]:
    llm = LLM(max_model_len=MAX_LEN, **kwargs)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


flex = generate(prompts, mask_mod=longformer, score_mod=sandwich)
reference = generate(prompts, mask_mod=longformer, score_mod=sandwich, attention_backend="reference")
print(f"longformer + sandwich, flex:      {flex}")
print(f"longformer + sandwich, reference: {reference}")
if flex != reference:
    sys.exit("FAILED: flex and the dense reference picked different tokens")
print("gym mods: flex == dense reference")


# 2. One prefix length per request instead of one captured for the batch
def prefix_lm(b, h, q_idx, kv_idx, prefix_len):  # the gym's mask with its constant made a parameter
    return (kv_idx <= q_idx) | (kv_idx < prefix_len[b])


lengths = [5, 11]
batched = generate(prompts, [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                            attention_params={"prefix_len": n}) for n in lengths], mask_mod=prefix_lm)
alone = [generate([p], mask_mod=generate_prefix_lm_mask(n))[0] for p, n in zip(prompts, lengths)]
print(f"per-request prefix_len {lengths}, batched: {batched}")
print(f"gym prefix-LM, each request alone:      {alone}")
if batched != alone:
    sys.exit("FAILED: per-request parameters and the gym's captured constant disagree")
print("per-request prefix_len == gym's mask per request")
