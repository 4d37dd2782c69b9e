"""Per-request attention parameters: a prefix-LM mask whose prefix length each request chooses.

The registered "prefix_lm" mask is `(kv <= q) | (kv < prefix_len[b])`: bidirectional over the first
prefix_len tokens of request b, causal after. Its value comes from
SamplingParams(attention_params={"prefix_len": P}); it is a tensor inside the engine, so requests with
different lengths share one batch (and, on a GPU, the same compiled kernels and CUDA graphs).
`prefix_len` is an int64 tensor because the mask leaves it unannotated; a mod that annotates a
parameter `float` (`def m(score, b, h, q_idx, kv_idx, cap: float)`) reads float32 values instead.
"""
import sys

from flexengine import LLM, SamplingParams

prompts = ["Translate to French: the cat sleeps. ->", "Summarise: paged attention splits the cache. ->",
           "Question: what is a prefix LM? Answer:"]
llm = LLM(mask_mod="prefix_lm")  # the prefix cache turns itself off: this mask looks ahead
lengths = [len(llm.get_tokenizer().encode(p)) for p in prompts]
prefix_lens = [0, lengths[1] // 2, lengths[2]]  # 0 is plain causal attention


def params(prefix_len: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=8, attention_params={"prefix_len": prefix_len})


batched = llm.generate(prompts, [params(p) for p in prefix_lens], use_tqdm=False)
for out, p, n in zip(batched, prefix_lens, lengths):
    print(f"prefix_len {p:2d} of {n:2d} prompt tokens: {out.prompt!r} -> {out.outputs[0].text!r}")

alone = [llm.generate([prompt], params(p), use_tqdm=False)[0] for prompt, p in zip(prompts, prefix_lens)]
if [o.outputs[0].token_ids for o in batched] != [o.outputs[0].token_ids for o in alone]:
    sys.exit("FAILED: a request's output changed with the batch it ran in")
print("batched == each request alone: every request used its own prefix length")
