"""SamplingParams(prompt_logprobs=k) against transformers' own forward: every prompt token's logprob,
rank and top k, over chunked prefill, with the prefix cache on, n > 1, and async scheduling."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flexengine import LLM, SamplingParams
from test_models_parity import hf_logprobs, make_checkpoint, random_prompt


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_checkpoint("llama", tmp_path_factory.mktemp("plp"))


def check_against_hf(hf, prompt, got, k):
    """got: RequestOutput.prompt_logprobs; each entry holds the prompt token and the top k."""
    ref = hf_logprobs(hf, prompt)  # row p scores token p + 1
    assert len(got) == len(prompt) and got[0] is None
    for pos in range(1, len(prompt)):
        entry, row, token = got[pos], ref[pos - 1], prompt[pos]
        assert token in entry and len(entry) in (k, k + 1), (pos, entry)
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=2e-3)
        assert entry[token].rank == int((row >= row[token]).sum())
        top = row.topk(k)
        for rank, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            assert t in entry and entry[t].logprob == pytest.approx(v, abs=2e-3), (pos, rank, t)


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(length=st.integers(2, 70), k=st.integers(0, 3), budget=st.sampled_from([8, 16, 64]), overlap=st.booleans(),
       n=st.sampled_from([1, 2]))
def test_prompt_logprobs_match_transformers(llama, length, k, budget, overlap, n):
    hf, path = llama
    llm = LLM(path, dtype="float32", block_size=4, num_kv_blocks=128, max_num_batched_tokens=budget,
              async_scheduling=overlap)
    prompt = random_prompt(length, seed=length)
    params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=k, n=n)
    first = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    check_against_hf(hf, prompt, first.prompt_logprobs, k)
    assert len(first.outputs) == n
    # The same prompt again: its pages are cached now, yet every prompt token is scored again.
    again = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    check_against_hf(hf, prompt, again.prompt_logprobs, k)
    assert llm.llm_engine.num_free_blocks() == llm.llm_engine.num_total_blocks


def test_prompt_logprobs_only_where_asked_and_validated(llama):
    _, path = llama
    llm = LLM(path, dtype="float32", block_size=4, num_kv_blocks=64)
    outs = llm.generate([{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4, 5, 6]}],
                        [SamplingParams(max_tokens=1, prompt_logprobs=1), SamplingParams(max_tokens=1)], use_tqdm=False)
    assert outs[0].prompt_logprobs is not None and outs[1].prompt_logprobs is None
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=1.5)


def test_prompt_logprobs_from_the_mixed_graphs(llama, gpu_shaped_engines):
    """The CUDA engine's path (steps with prompt tokens replayed from mixed graphs, run eagerly on CPU):
    the hidden states the scores come from are the graph's static output."""
    hf, path = llama
    llm = LLM(path, dtype="float32", block_size=4, num_kv_blocks=96, max_num_seqs=2, max_num_batched_tokens=32,
              max_model_len=128, async_scheduling=True)
    assert llm.llm_engine.runner.mixed_graphs is not None
    prompts = [random_prompt(50, seed=7), random_prompt(9, seed=8)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=2, prompt_logprobs=1),
                        use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        check_against_hf(hf, prompt, out.prompt_logprobs, 1)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), n=st.integers(1, 12), k=st.integers(0, 3))
def test_flat_logprobs_read_as_vllms_list_of_dicts(data, n, k):
    """FlatLogprobs, filled in chunks (some positions twice, as after a preemption), reads as the plain list
    vLLM returns: None first, then per position the top k with ranks 1..k and the prompt token with its own
    rank (a top-k token keeps the sampler's rank); slices, negative indices, and pickling (texts carried)."""
    import pickle

    from flexengine.outputs import FlatLogprobs, Logprob
    V = 6
    prompt = data.draw(st.lists(st.integers(0, V - 1), min_size=n, max_size=n))
    rows = [None] + [(data.draw(st.floats(-9, 0, width=32)), data.draw(st.integers(1, V)),
                      data.draw(st.lists(st.integers(0, V - 1), min_size=k, max_size=k, unique=True)),
                      sorted(data.draw(st.lists(st.floats(-9, 0, width=32), min_size=k, max_size=k)), reverse=True))
                     for _ in range(n - 1)]
    want = [None]
    for token, (chosen, rank, ids, lps) in zip(prompt[1:], rows[1:]):
        entry = {t: Logprob(v, r, f"<{t}>") for r, (t, v) in enumerate(zip(ids, lps), start=1)}
        entry[token] = Logprob(entry[token].logprob if token in entry else chosen, rank, f"<{token}>")
        want.append(entry)
    flat = FlatLogprobs(prompt, k, lambda t: f"<{t}>")
    cuts = sorted(data.draw(st.lists(st.integers(1, n), max_size=3))) + [n]
    start = 1
    for stop in cuts:  # chunks, each from a little before the last one's end (positions written twice)
        first = max(1, start - data.draw(st.integers(0, 2)))
        if stop <= first:
            continue
        part = rows[first:stop]
        flat.fill(first, np.array([r[0] for r in part], np.float32), np.array([r[1] for r in part]),
                  np.array([r[2] for r in part], np.int64).reshape(len(part), k),
                  np.array([r[3] for r in part], np.float32).reshape(len(part), k))
        start = stop
    assert len(flat) == n and flat == want and list(flat) == want
    assert flat[1:] == want[1:] and flat[-1] == want[-1] and flat[::2] == want[::2]
    again = pickle.loads(pickle.dumps(flat))
    assert again == want and isinstance(again.text_of, dict)
