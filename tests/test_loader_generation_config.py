"""A checkpoint's generation_config.json sets the sampling defaults of calls that pass no
SamplingParams (vLLM's --generation-config auto); explicit params still win."""
from __future__ import annotations

import torch
from transformers import GenerationConfig

from flexengine import LLM, SamplingParams
from test_loader import save_llama


def test_generation_config_sets_the_defaults(tmp_path):
    hf = save_llama(tmp_path)
    GenerationConfig(do_sample=True, top_k=1, top_p=0.9, max_new_tokens=5, repetition_penalty=1.0,
                     bos_token_id=1).save_pretrained(str(tmp_path))
    llm = LLM(str(tmp_path), num_kv_blocks=16, block_size=16)
    defaults = llm.get_default_sampling_params()
    assert (defaults.top_k, defaults.top_p, defaults.max_tokens, defaults.temperature) == (1, 0.9, 5, 1.0)
    ids = [5, 17, 99, 3]
    out = llm.generate({"prompt_token_ids": ids}, use_tqdm=False)[0].outputs[0]
    # top_k=1 is greedy: transformers' greedy tokens, as many as max_new_tokens says
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False, attention_mask=torch.ones(1, 4))
    assert out.token_ids == ref[0, 4:].tolist()
    explicit = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert len(explicit[0].outputs[0].token_ids) == 2


def test_without_generation_config_the_defaults_are_vllms(tmp_path):
    save_llama(tmp_path)
    llm = LLM(str(tmp_path), num_kv_blocks=16, block_size=16)
    assert llm.get_default_sampling_params() == SamplingParams()
