"""A long prompt through the engine (issue 24's correctness): thousands of tokens prefilled over many
chunks, a sliding-window model, the prefix cache on; greedy tokens and their logprobs against
transformers' own forward of a tiny random checkpoint."""
from __future__ import annotations

import pytest
import torch
import transformers

from flexengine import LLM, SamplingParams
from test_models_parity import TINY, assert_matches_hf, random_prompt

WINDOW = 48  # a few pages of 16: far context is hidden, so a wrong window shows


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    config = transformers.MistralConfig(**{**TINY, "max_position_embeddings": 4096}, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                                        architectures=["MistralForCausalLM"])
    torch.manual_seed(0)
    hf = transformers.MistralForCausalLM._from_config(config, attn_implementation="eager").eval()
    path = tmp_path_factory.mktemp("long") / "mistral"
    hf.save_pretrained(path)
    return hf, str(path)


def generate(llm, prompt, n=4):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    return out.token_ids, [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]


def test_long_prompt_in_many_chunks_with_a_window_and_the_prefix_cache(mistral):
    hf, path = mistral
    llm = LLM(path, dtype="float32", block_size=16, max_num_batched_tokens=256, enable_prefix_caching=True,
              num_kv_blocks=400)
    assert llm.llm_engine.max_model_len == 4096  # the model's own context
    prompt = random_prompt(2500, seed=1)  # ten chunks of 256
    assert_matches_hf(hf, prompt, *generate(llm, prompt))
    # A second prompt sharing 2,000 tokens: its first pages come from the prefix cache.
    bm = llm.llm_engine.block_manager
    hits = bm.num_hits
    other = prompt[:2000] + random_prompt(300, seed=2)
    assert_matches_hf(hf, other, *generate(llm, other))
    assert bm.num_hits - hits >= 2000 // 16 - 1


def test_a_cache_smaller_than_the_context_caps_max_model_len_and_says_so(mistral, caplog):
    _, path = mistral
    with caplog.at_level("WARNING", logger="flexengine"):
        llm = LLM(path, dtype="float32", block_size=16, num_kv_blocks=40)
    assert llm.llm_engine.max_model_len == 640
    said = [r.getMessage() for r in caplog.records if "max_model_len is 640" in r.getMessage()]
    assert said and "4096" in said[0] and "num_kv_blocks" in said[0], caplog.text
    free = llm.llm_engine.num_free_blocks()
    with pytest.raises(ValueError, match="max_model_len=640"):
        llm.generate([{"prompt_token_ids": random_prompt(700, seed=3)}], SamplingParams(max_tokens=1), use_tqdm=False)
    assert llm.llm_engine.num_free_blocks() == free  # the refused request holds no page
    assert len(generate(llm, random_prompt(600, seed=4), n=2)[0]) == 2  # and the engine still serves


def test_default_max_model_len_is_the_models_whole_context(tmp_path):
    """Past the 8,192 tokens the engine used to cap it at: unasked, max_model_len is the config's
    max_position_embeddings when the cache holds one such request, and a prompt past the old cap is
    served (the first test proves parity at length; this one, that the default lets it in)."""
    config = transformers.LlamaConfig(**{**TINY, "max_position_embeddings": 12000}, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM._from_config(config, attn_implementation="eager").eval()
    hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", block_size=16, num_kv_blocks=760, max_num_batched_tokens=2048)
    assert llm.llm_engine.max_model_len == 12000
    out = llm.generate([{"prompt_token_ids": random_prompt(8500, seed=5)}], SamplingParams(max_tokens=2),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2
    assert llm.llm_engine.num_free_blocks() == llm.llm_engine.num_total_blocks
