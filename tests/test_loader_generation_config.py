"""A checkpoint's generation_config.json sets the sampling defaults of calls that pass no
SamplingParams (vLLM's --generation-config auto); explicit params still win."""
from __future__ import annotations

import torch
from transformers import GenerationConfig

from flexengine import LLM, SamplingParams
from flexengine.tokenizer import save_byte_tokenizer
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


def test_server_applies_generation_config_to_fields_a_request_leaves_out(tmp_path):
    """`flexengine serve DIR`: a completion without max_tokens or sampling fields gets the checkpoint's
    (top_k=1: greedy, max_new_tokens=3); fields a request sets win."""
    import httpx
    from test_server import ENGINE_ARGS, launch_server, stop_server, wait_ready

    save_llama(tmp_path)
    save_byte_tokenizer(str(tmp_path))
    GenerationConfig(do_sample=True, top_k=1, max_new_tokens=3).save_pretrained(str(tmp_path))
    offline = LLM(str(tmp_path), num_kv_blocks=16, block_size=16, attention_backend="reference")
    greedy = offline.generate("hello", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0]
    proc, url, log = launch_server(str(tmp_path), "--num-kv-blocks", "16", *ENGINE_ARGS)
    try:
        wait_ready(proc, url, log)
        plain = httpx.post(url + "/v1/completions", json={"prompt": "hello", "ignore_eos": True}, timeout=60).json()
        assert plain["usage"]["completion_tokens"] == 3
        assert plain["choices"][0]["text"] == offline.get_tokenizer().decode(greedy.token_ids[:3])
        asked = httpx.post(url + "/v1/completions", json={"prompt": "hello", "ignore_eos": True, "max_tokens": 5,
                                                          "temperature": 0}, timeout=60).json()
        assert asked["usage"]["completion_tokens"] == 5 and asked["choices"][0]["text"] == greedy.text
    finally:
        stop_server(proc)


def test_request_fields_set_win_over_the_defaults():
    from flexengine.server.protocol import CompletionRequest
    defaults = {"temperature": 0.3, "top_k": 7, "repetition_penalty": 1.2, "max_tokens": 3}
    left_out = CompletionRequest(prompt="x").to_sampling_params(16, None, defaults=defaults)
    assert (left_out.temperature, left_out.top_k, left_out.repetition_penalty) == (0.3, 7, 1.2)
    given = CompletionRequest(prompt="x", temperature=1.0, top_k=-1).to_sampling_params(16, None, defaults=defaults)
    assert (given.temperature, given.top_k, given.repetition_penalty) == (1.0, -1, 1.2)
