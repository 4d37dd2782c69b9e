"""The offline API: prompt forms, output order and fields, and bad input.

Every bad input must raise ValueError naming the problem, leave no page allocated and no request
queued, and the same LLM must then serve the next call normally."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flexengine
from flexengine import LLM, CompletionOutput, RequestOutput, SamplingParams
from flexengine.config import EngineConfig, default_block_size, default_max_num_batched_tokens
from test_engine import VOCAB, checkpoint, hf_greedy, prompts_of


@pytest.fixture(scope="module")
def llm():
    return LLM(num_kv_blocks=16, max_model_len=64, attention_backend="reference")


@pytest.fixture(scope="module")
def tiny():
    return LLM(checkpoint()[1], num_kv_blocks=16, max_model_len=64)


def assert_clean(llm):
    engine = llm.llm_engine
    assert engine.num_free_blocks() == engine.num_total_blocks
    assert not engine.has_unfinished_requests() and engine.get_num_unfinished_requests() == 0


def test_exports():
    assert {"LLM", "SamplingParams", "RequestOutput", "CompletionOutput"} <= set(flexengine.__all__)


def test_prompt_forms_and_order(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("token ids")
    outs = llm.generate(["first", {"prompt_token_ids": ids}, "third prompt"],
                        SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert [o.prompt for o in outs] == ["first", None, "third prompt"]
    assert outs[1].prompt_token_ids == ids and outs[0].prompt_token_ids == tok.encode("first")
    for o in outs:
        assert isinstance(o, RequestOutput) and o.finished
        c = o.outputs[0]
        assert isinstance(c, CompletionOutput) and c.index == 0 and len(c.token_ids) == 4
        assert c.finish_reason == "length" and c.text == tok.decode(c.token_ids) and c.logprobs is None
    single = llm.generate("first", SamplingParams(temperature=0, max_tokens=4))  # one prompt, tqdm on
    assert len(single) == 1 and single[0].outputs[0].text == outs[0].outputs[0].text
    per_prompt = llm.generate(["first", "first"], [SamplingParams(temperature=0, max_tokens=2),
                                                   SamplingParams(temperature=0, max_tokens=3)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in per_prompt] == [2, 3]
    default = llm.generate("defaults", use_tqdm=False)[0].outputs[0]
    assert len(default.token_ids) == 16  # SamplingParams() as vLLM: max_tokens=16
    assert_clean(llm)


def test_generate_matches_transformers_for_token_prompts(tiny):
    prompts = prompts_of([3, 18])
    outs = tiny.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy("llama", tuple(p), 5) for p in prompts]


@pytest.mark.parametrize("kwargs, field", [
    (dict(n=0), "n"), (dict(temperature=-0.5), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"), (dict(min_p=1.5), "min_p"),
    (dict(max_tokens=0), "max_tokens"), (dict(logprobs=-1), "logprobs"), (dict(seed=1.5), "seed"),
    (dict(stop=[""]), "stop"), (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(temperature="hot"), "temperature"),
    (dict(ignore_eos="yes"), "ignore_eos"), (dict(attention_params=[1]), "attention_params"),
])
def test_sampling_params_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_like_vllm():
    p = SamplingParams(stop="x", top_k=0)
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, p.stop) == (1, 1.0, 1.0, -1, 0.0, 16, ["x"])


BAD_INPUTS = [
    ({"prompt_token_ids": []}, None, "empty"),
    ({"prompt_token_ids": list(range(65))}, None, "max_model_len"),
    ({"prompt_token_ids": [1, 2, 10 ** 6]}, None, "outside the vocabulary"),
    ({"prompt_token_ids": [1, -3]}, None, "outside the vocabulary"),
    ({"prompt_token_ids": "abc"}, None, "list of integers"),
    ({"prompt_token_ids": [1, True, 3]}, None, "list of integers"),
    ({"prompt_token_ids": [1, 2.0]}, None, "list of integers"),
    ({"prompt_token_ids": [1, None]}, None, "list of integers"),
    ({"prompt_token_ids": [5, 7, 10 ** 6, -1]}, None, r"prompt token id 1000000 is outside"),
    ({"prompt": "no ids"}, None, "prompt_token_ids"),
    (42, None, "prompt must be"),
    ("fine", "not params", "SamplingParams"),
    ("fine", SamplingParams(logprobs=10 ** 6), "logprobs"),
    ("fine", SamplingParams(stop_token_ids=[10 ** 6]), "stop_token_ids"),
]


@pytest.mark.parametrize("prompt, params, message", BAD_INPUTS)
def test_bad_input_raises_and_leaks_nothing(llm, prompt, params, message):
    total = llm.llm_engine.num_total_blocks
    assert llm.llm_engine.num_free_blocks() == total
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, params, use_tqdm=False)
    assert_clean(llm)
    # A valid request queued before the bad one is undone as well.
    with pytest.raises(ValueError, match=message):
        llm.generate(["a valid prompt", prompt], [SamplingParams(max_tokens=3), params or SamplingParams()],
                     use_tqdm=False)
    assert_clean(llm)
    out = llm.generate("still works", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3
    assert_clean(llm)


def test_mismatched_params_list(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    assert_clean(llm)


def test_string_prompt_without_tokenizer(tiny):
    with pytest.raises(ValueError, match="tokenizer"):
        tiny.generate("text", use_tqdm=False)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        tiny.generate({"prompt_token_ids": [1, 2]}, SamplingParams(stop=["x"]), use_tqdm=False)
    assert_clean(tiny)


def test_prompt_filling_max_model_len_gets_one_token(llm):
    out = llm.generate({"prompt_token_ids": [65] * 64}, SamplingParams(max_tokens=5), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
    assert_clean(llm)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_kv_blocks=3, max_model_len=64), "needs 4 blocks"),
    (dict(num_kv_blocks=0), "num_kv_blocks"),
    (dict(block_size=0), "block_size"),
    (dict(max_model_len=10 ** 6), "max_position_embeddings"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(attention_backend="nope"), "attention_backend"),
    (dict(dtype="int3"), "dtype"),
])
def test_bad_engine_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(**kwargs)


def test_engine_config_defaults(monkeypatch):
    c = EngineConfig()
    assert (c.block_size, c.max_num_seqs, c.max_num_batched_tokens, c.enable_prefix_caching, c.seed) == \
        (None, 256, None, True, 0)
    llm = LLM(num_kv_blocks=8, mask_mod="causal", score_mod=None)
    assert llm.config.mask_mod == "causal"
    assert llm.config.block_size == llm.llm_engine.block_manager.block_size == 16  # the CPU's
    monkeypatch.delenv("FLEXENGINE_ATTENTION_BACKEND", raising=False)
    assert default_block_size("cuda", None) == default_block_size("cuda", "flex") == 128  # flex's decode tile
    assert default_block_size("cuda", "flash") == default_block_size("cpu", "flex") == 16
    monkeypatch.setenv("FLEXENGINE_ATTENTION_BACKEND", "reference")
    assert default_block_size("cuda", None) == 16
    assert llm.config.max_num_batched_tokens == llm.llm_engine.scheduler.max_num_batched_tokens == 2048  # the CPU's
    assert default_max_num_batched_tokens("cuda") == 8192  # vLLM's LLM default below 70 GiB, its server's above
    assert LLM(num_kv_blocks=8, max_num_batched_tokens=64).llm_engine.scheduler.max_num_batched_tokens == 64


def test_default_max_model_len_fits_the_cache():
    small = LLM(num_kv_blocks=4, block_size=8)
    assert small.llm_engine.max_model_len == 32  # capped by the cache when not asked for
    assert VOCAB == 300


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2 ** 16), max_tokens=st.integers(1, 24), stop_at=st.integers(0, 255))
def test_offline_text_decoded_at_the_end_equals_streamed_text(llm, seed, max_tokens, stop_at):
    """LLM.generate decodes a request's text once, when it finishes; the step API decodes token by
    token. Random sampling on the byte-level default model makes split UTF-8 characters, stop tokens
    and length cut-offs; both must give the same text."""
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, stop_token_ids=[stop_at])
    prompt = {"prompt_token_ids": [72, 105, 0xC3]}  # ends inside a character
    offline = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    engine = llm.llm_engine
    engine.add_request("streamed", prompt, params)
    streamed = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed = out.outputs[0]
    assert streamed.token_ids == offline.token_ids
    assert (streamed.text, streamed.finish_reason) == (offline.text, offline.finish_reason)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2 ** 16), max_tokens=st.integers(1, 24),
       stop=st.lists(st.text(alphabet="aeiou ", min_size=1, max_size=3), max_size=2))
def test_delta_outputs_add_up_to_the_cumulative_ones(llm, seed, max_tokens, stop):
    """A request added with delta=True (the server's engine process) reports only what is new; joined,
    its outputs are the cumulative ones: text (stop strings held back, then cut), tokens, logprobs."""
    params = SamplingParams(n=2, temperature=1.0, seed=seed, max_tokens=max_tokens, stop=stop, logprobs=1)
    prompt = {"prompt_token_ids": [72, 105, 0xC3]}
    engine = llm.llm_engine
    runs = {}
    for delta in (False, True):
        engine.add_request("r", prompt, params, delta=delta)
        joined = {i: ["", [], [], None] for i in range(2)}
        while engine.has_unfinished_requests():
            for out in engine.step():
                for c in out.outputs:
                    j = joined[c.index]
                    if delta:
                        j[0], j[1], j[2] = j[0] + c.text, j[1] + c.token_ids, j[2] + c.logprobs
                    else:
                        assert c.text.startswith(j[0])  # cumulative text never shrinks
                        j[0], j[1], j[2] = c.text, c.token_ids, c.logprobs
                    j[3] = c.finish_reason
        runs[delta] = {i: (text, tokens, [sorted(lp) for lp in lps], reason)
                       for i, (text, tokens, lps, reason) in joined.items()}
    assert runs[True] == runs[False]
    assert_clean(llm)


def test_generation_runs_with_the_heap_frozen_then_unfreezes_it(llm, monkeypatch):
    """Garbage collections during generate() skip what existed before it; afterwards the heap is as it
    was: unfrozen, or frozen by its owner."""
    import gc
    engine, seen = llm.llm_engine, []
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: seen.append(gc.get_freeze_count()) or step())
    assert gc.get_freeze_count() == 0
    llm.generate([{"prompt_token_ids": [1, 2, 3]}] * 3, SamplingParams(max_tokens=4), use_tqdm=False)
    assert seen and min(seen) > 10_000 and gc.get_freeze_count() == 0
    gc.freeze()  # the caller froze its own heap: generate leaves that alone
    try:
        frozen = gc.get_freeze_count()
        llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2), use_tqdm=False)
        assert gc.get_freeze_count() > frozen // 2  # still frozen (a few frozen objects died meanwhile)
    finally:
        gc.unfreeze()
    assert_clean(llm)


def test_request_metrics_time_the_first_token(llm):
    """RequestOutput.metrics (vLLM's names): arrival <= first token <= finished, in time.time() seconds."""
    import time
    before = time.time()
    out = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=3), use_tqdm=False)
    after = time.time()
    for o in out:
        m = o.metrics
        assert before <= m.arrival_time <= m.first_token_time <= m.finished_time <= after, m
