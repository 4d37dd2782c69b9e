"""The engine end to end against transformers: batched greedy generation over tiny random checkpoints
(saved by transformers, fp32, CPU) must give exactly the tokens transformers' own `generate` gives
for each prompt alone, however the engine batches, chunks, caches prefixes or preempts."""
from __future__ import annotations

import functools
import tempfile

import pytest
import torch
import transformers

from flexengine import LLM, SamplingParams
from flexengine.config import EngineConfig
from flexengine.engine.llm_engine import LLMEngine

VOCAB = 300
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)
ARCHS = {"llama": ("LlamaConfig", "LlamaForCausalLM", {}),
         "mistral": ("MistralConfig", "MistralForCausalLM", dict(head_dim=16, sliding_window=6))}


@functools.cache
def checkpoint(arch: str = "llama"):
    """(transformers model, checkpoint directory) of a tiny random model, built once per session."""
    cfg_cls, cls, extra = ARCHS[arch]
    config = getattr(transformers, cfg_cls)(**TINY, **extra, architectures=[cls])
    torch.manual_seed(0)
    hf = getattr(transformers, cls)._from_config(config, attn_implementation="eager").float().eval()
    path = tempfile.mkdtemp(prefix=f"flexengine-test-{arch}-")
    hf.save_pretrained(path)
    return hf, path


@functools.cache
def hf_greedy(arch: str, prompt: tuple[int, ...], max_new: int) -> list[int]:
    hf, _ = checkpoint(arch)
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                      eos_token_id=None, pad_token_id=VOCAB - 1)
    return out[0, len(prompt):].tolist()


def prompts_of(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
MIXED = prompts_of([1, 7, 16, 17, 40, 3, 65])


def assert_parity(llm, prompts, arch="llama", params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts  # input order
    for p, o in zip(prompts, outs):
        assert o.finished and o.outputs[0].finish_reason == "length"
        assert o.outputs[0].token_ids == hf_greedy(arch, tuple(p), params.max_tokens), f"prompt of {len(p)} tokens"
    engine = llm.llm_engine
    assert engine.num_free_blocks() == engine.num_total_blocks and not engine.has_unfinished_requests()
    return outs


def test_batched_parity_mixed_lengths():
    _, path = checkpoint()
    assert_parity(LLM(path, num_kv_blocks=32), MIXED)


def test_chunk_budget_of_8_and_sliding_window():
    _, path = checkpoint("mistral")
    llm = LLM(path, num_kv_blocks=24, block_size=8, max_num_batched_tokens=8)
    assert_parity(llm, prompts_of([1, 7, 17, 26]), arch="mistral")


def test_prefix_caching_on_and_off():
    _, path = checkpoint()
    shared = prompts_of([26], seed=3)[0]
    prompts = [shared + s for s in prompts_of([1, 6, 11], seed=4)] + [shared[:10]]
    on = LLM(path, num_kv_blocks=32, block_size=8, max_num_batched_tokens=32)
    assert_parity(on, prompts)
    first_hits = on.llm_engine.block_manager.num_hits
    assert first_hits > 0  # later prompts were admitted after the first one's pages were cached
    outs = assert_parity(on, prompts)  # a second call hits everything but the last partial page
    assert on.llm_engine.block_manager.num_hits > first_hits
    assert all(o.num_cached_tokens > 0 for o in outs[:3])
    off = LLM(path, num_kv_blocks=32, block_size=8, max_num_batched_tokens=32, enable_prefix_caching=False)
    assert_parity(off, prompts)
    assert off.llm_engine.block_manager.num_hits == 0


def test_preemption_keeps_greedy_outputs():
    _, path = checkpoint()
    prompts = prompts_of([21, 12, 17, 8, 10])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(path, num_kv_blocks=10, block_size=4, max_model_len=40)
    assert_parity(llm, prompts, params=params)
    assert llm.llm_engine.scheduler.num_preemptions > 0


def test_step_api_streams_cumulative_outputs_and_abort_frees_pages():
    _, path = checkpoint()
    engine = LLMEngine(EngineConfig(model=path, num_kv_blocks=32, block_size=4))
    total = engine.num_total_blocks
    a, b = prompts_of([10, 6], seed=7)
    engine.add_request("a", {"prompt_token_ids": a}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    engine.add_request("b", b, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert engine.get_num_unfinished_requests() == 2
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", b, GREEDY)
    seen = {"a": [], "b": []}
    for _ in range(3):
        for out in engine.step():
            tokens = out.outputs[0].token_ids
            assert tokens[:len(seen[out.request_id])] == seen[out.request_id]  # cumulative
            assert len(tokens) == len(seen[out.request_id]) + 1
            seen[out.request_id] = tokens
    before = engine.num_free_blocks()
    engine.abort_request("b")  # 8 tokens computed: 2 pages of 4, freed at once
    assert engine.num_free_blocks() == before + 2
    assert engine.get_num_unfinished_requests() == 1
    last = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "a"
            last = out
    assert last.finished and last.outputs[0].token_ids == hf_greedy("llama", tuple(a), 6)
    assert engine.num_free_blocks() == total and engine.get_num_unfinished_requests() == 0
    engine.abort_request("unknown")  # ignored


def test_max_model_len_finishes_with_length():
    _, path = checkpoint()
    llm = LLM(path, num_kv_blocks=8, block_size=4, max_model_len=20)
    prompt = prompts_of([15])[0]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"
    assert out.outputs[0].token_ids == hf_greedy("llama", tuple(prompt), 5)


def test_eos_stops_unless_ignored():
    _, path = checkpoint()
    llm = LLM(path, num_kv_blocks=16)
    prompt = {"prompt_token_ids": MIXED[2]}
    expected = hf_greedy("llama", tuple(MIXED[2]), 8)
    llm.llm_engine.eos_token_ids = frozenset({expected[3]})
    first = expected.index(expected[3])
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == expected[:first + 1] and out.finish_reason == "stop" and out.stop_reason is None
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected
