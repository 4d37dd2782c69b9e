"""Sampling: the sampler's filters and distribution, per-request seeds, stops, n, logprobs.

Filtered tokens are checked against allowed sets computed independently (numpy on the same logits for
the sampler; transformers' forward for the engine)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexengine import LLM, SamplingParams
from flexengine.layers.sampler import Sampler, SamplingTensors, compute_logprobs
from test_engine import VOCAB, checkpoint, prompts_of


def allowed_set(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> set[int]:
    """vLLM's order: temperature, min-p, top-k, then top-p over the renormalised survivors."""
    x = logits.astype(np.float64) / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    keep = p >= min_p * p.max()
    order = [i for i in np.argsort(-x, kind="stable") if keep[i]]
    if top_k > 0:
        order = order[:top_k]
    q = p[order] / p[order].sum()
    out, mass = [], 0.0
    for i, qi in zip(order, q):
        out.append(int(i))
        mass += qi
        if mass >= top_p - 1e-6:
            break
    return set(out)


def tensors(rows, generators=(), device="cpu"):
    t, k, p, m = zip(*rows)
    V = 10 ** 6
    return SamplingTensors(temperature=torch.tensor(t), top_k=torch.tensor([x if x > 0 else V for x in k]),
                           top_p=torch.tensor(p), min_p=torch.tensor(m), generators=tuple(generators),
                           all_greedy=all(x == 0 for x in t))


def test_filters_never_emit_a_disallowed_token():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 40, generator=g) * 3
    rows = [(1.0, 3, 1.0, 0.0), (0.7, -1, 0.5, 0.0), (1.3, -1, 1.0, 0.2), (2.0, 5, 0.8, 0.05), (1.0, 1, 1.0, 0.0),
            (0.5, 10, 0.9, 0.1)]
    draws = 300  # each row repeated: one sampler call draws them all
    ids = Sampler(torch.Generator().manual_seed(1))(logits.repeat(draws, 1), tensors(rows * draws)).token_ids
    seen = [set(ids[i::len(rows)].tolist()) for i in range(len(rows))]
    for i, row in enumerate(rows):
        allowed = allowed_set(logits[i].numpy(), *row)
        assert seen[i] <= allowed, (row, seen[i] - allowed)
        assert len(seen[i]) == len(allowed) or len(allowed) > 8  # small allowed sets are all reached


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[1.0, 0.5, 0.0, -1.0, 2.0]]).repeat(20000, 1)
    out = Sampler(torch.Generator().manual_seed(0))(logits, tensors([(0.7, -1, 1.0, 0.0)] * 20000)).token_ids
    freq = torch.bincount(out, minlength=5).float() / 20000
    assert torch.allclose(freq, (logits[0] / 0.7).softmax(-1), atol=0.015)
    out = Sampler(torch.Generator().manual_seed(0))(logits, tensors([(1.0, 2, 1.0, 0.0)] * 20000)).token_ids
    freq = torch.bincount(out, minlength=5).float() / 20000
    expected = torch.zeros(5)
    expected[[4, 0]] = torch.tensor([2.0, 1.0]).softmax(-1)
    assert torch.allclose(freq, expected, atol=0.015)


def test_greedy_rows_and_seeded_rows_ignore_the_rest_of_the_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g)
    alone = [Sampler()(logits[2:3], tensors([(1.0, -1, 1.0, 0.0)], [torch.Generator().manual_seed(9)]))
             .token_ids.item() for _ in range(1)]
    gen_alone, gen_batch = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    seq_alone, seq_batch = [], []
    for _ in range(20):
        seq_alone.append(Sampler()(logits[2:3], tensors([(1.0, -1, 1.0, 0.0)], [gen_alone])).token_ids.item())
        rows = [(0.0, -1, 1.0, 0.0), (1.0, -1, 1.0, 0.0), (1.0, -1, 1.0, 0.0), (1.0, 3, 1.0, 0.0)]
        out = Sampler()(logits, tensors(rows, [None, None, gen_batch, None])).token_ids
        assert out[0].item() == logits[0].argmax().item()
        seq_batch.append(out[2].item())
    assert seq_alone == seq_batch and seq_alone[0] == alone[0]
    assert len(set(seq_alone)) > 1


def test_compute_logprobs_ranks_and_top():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 1.0, 1.5, 0.0]])
    chosen, rank, top_ids, top_lps = compute_logprobs(logits, torch.tensor([2, 0]), 2)
    ref = logits.log_softmax(-1)
    assert torch.allclose(chosen, ref[[0, 1], [2, 0]]) and rank.tolist() == [3, 1]
    assert top_ids.tolist() == [[1, 3], [0, 2]] and torch.allclose(top_lps, ref.gather(1, top_ids))


# ------------------------------------------------------------------------------------------ engine level
# Sampling does not depend on the attention backend (test_engine checks the default one against
# transformers); the reference backend keeps these CPU tests fast.
@pytest.fixture(scope="module")
def default_llm():
    return LLM(num_kv_blocks=16, attention_backend="reference")


@pytest.fixture(scope="module")
def tiny_llm():
    return LLM(checkpoint()[1], num_kv_blocks=16, attention_backend="reference")


@torch.no_grad()
def hf_logits(ids: list[int]) -> torch.Tensor:
    hf, _ = checkpoint()
    return hf(torch.tensor([ids])).logits[0].float()  # [len, vocab]: row i predicts token i + 1


def test_seed_reproducible_regardless_of_batch(default_llm):
    p = SamplingParams(temperature=1.0, seed=42, max_tokens=10, ignore_eos=True)
    alone = default_llm.generate("The quick brown fox", p, use_tqdm=False)[0].outputs[0].text
    others = [SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=7, max_tokens=5, ignore_eos=True), p,
              SamplingParams(temperature=0, max_tokens=9)]
    outs = default_llm.generate(["Hi", "Once upon a time, in a land far away", "The quick brown fox", "x"], others,
                                use_tqdm=False)
    assert outs[2].outputs[0].text == alone
    other_seed = SamplingParams(temperature=1.0, seed=43, max_tokens=10, ignore_eos=True)
    assert default_llm.generate("The quick brown fox", other_seed, use_tqdm=False)[0].outputs[0].text != alone


def test_seeded_sampling_survives_preemption(tiny_llm):
    prompts = [{"prompt_token_ids": p} for p in prompts_of([21, 12, 17, 9], seed=8)]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=8, ignore_eos=True) for s in range(4)]
    roomy = tiny_llm.generate(prompts, params, use_tqdm=False)
    tight = LLM(checkpoint()[1], num_kv_blocks=10, block_size=4, max_model_len=40, attention_backend="reference")
    cramped = tight.generate(prompts, params, use_tqdm=False)
    assert tight.llm_engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in cramped] == [o.outputs[0].token_ids for o in roomy]


@pytest.mark.parametrize("params", [dict(top_k=3), dict(top_p=0.4), dict(min_p=0.3),
                                    dict(top_k=5, top_p=0.7, min_p=0.1)])
def test_engine_filters_against_transformers_logits(tiny_llm, params):
    sp = SamplingParams(temperature=1.5, seed=5, max_tokens=6, ignore_eos=True, **params)
    prompts = prompts_of([5, 12, 20], seed=11)
    outs = tiny_llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    full = dict(top_k=-1, top_p=1.0, min_p=0.0) | params
    for prompt, out in zip(prompts, outs):
        gen = out.outputs[0].token_ids
        logits = hf_logits(prompt + gen)
        for i, token in enumerate(gen):
            row = logits[len(prompt) - 1 + i].numpy()
            assert token in allowed_set(row, 1.5, full["top_k"], full["top_p"], full["min_p"])


def test_logprobs_match_log_softmax(tiny_llm):
    prompt = prompts_of([9], seed=5)[0]
    sp = SamplingParams(temperature=1.0, seed=1, max_tokens=6, ignore_eos=True, logprobs=3)
    out = tiny_llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 6
    ref = hf_logits(prompt + out.token_ids).log_softmax(-1)
    total = 0.0
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert token in entry and len(entry) in (3, 4)
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(3)
        for r, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist())):
            assert entry[t].rank == r + 1 and entry[t].logprob == pytest.approx(v, abs=1e-4)
        total += entry[token].logprob
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)
    greedy = tiny_llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=3, logprobs=0),
                               use_tqdm=False)[0].outputs[0]
    assert all(list(e) == [t] and e[t].rank == 1 for t, e in zip(greedy.token_ids, greedy.logprobs))


def test_logprobs_decoded_token(default_llm):
    out = default_llm.generate("abc", SamplingParams(temperature=0, max_tokens=4, logprobs=2), use_tqdm=False)[0]
    tok = default_llm.get_tokenizer()
    for entry in out.outputs[0].logprobs:
        assert all(lp.decoded_token == tok.decode([t]) for t, lp in entry.items())


def test_stop_strings_cut_exactly(default_llm):
    base = default_llm.generate("Stop here", SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    text = base.outputs[0].text
    stop = text[8:11]
    cut = text.find(stop)
    out = default_llm.generate("Stop here", SamplingParams(temperature=0, max_tokens=24, stop=[stop]),
                               use_tqdm=False)[0].outputs[0]
    assert out.text == text[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    # The earliest of several stop strings wins; a stop string never shows in streamed text.
    later = text[15:17]
    engine = default_llm.llm_engine
    engine.add_request("s", "Stop here", SamplingParams(temperature=0, max_tokens=24, stop=[later, stop]))
    shown = ""
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.outputs[0].text.startswith(shown) and stop not in o.outputs[0].text
            shown = o.outputs[0].text
    first = min(text.find(s) for s in (later, stop))
    assert shown == text[:first] and engine.num_free_blocks() == engine.num_total_blocks


def test_stop_token_ids(tiny_llm):
    prompt = {"prompt_token_ids": prompts_of([7], seed=2)[0]}
    base = tiny_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids
    stop_id = base[4]
    out = tiny_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                   stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base[:base.index(stop_id) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_n_completions(default_llm):
    sp = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    out = default_llm.generate("Many ways", sp, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    texts = [c.text for c in out.outputs]
    assert len(set(texts)) > 1 and all(len(c.token_ids) == 12 for c in out.outputs)
    again = default_llm.generate("Many ways", sp, use_tqdm=False)[0]
    assert [c.text for c in again.outputs] == texts
    greedy = default_llm.generate("Many ways", SamplingParams(n=2, temperature=0, max_tokens=8), use_tqdm=False)[0]
    single = default_llm.generate("Many ways", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert greedy.outputs[0].text == greedy.outputs[1].text == single.outputs[0].text
    assert default_llm.llm_engine.num_free_blocks() == default_llm.llm_engine.num_total_blocks


def test_vocab_constant_matches_checkpoint():
    assert checkpoint()[0].config.vocab_size == VOCAB


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_sampling_inputs_and_the_sampler_never_wait_for_the_device(async_scheduling, monkeypatch):
    """The sampling inputs of a step are built while the device runs its forward: an op among them that
    needs a device value on the host (a boolean-mask index, `.item()`) would stall the host until the forward
    is done. Every sampling feature at once, prompt logprobs too, with and without async scheduling (PENDING
    histories)."""
    from flexengine import StructuredOutputsParams
    from flexengine.engine import model_runner
    from sync_guard import no_device_syncs
    llm = LLM(seed=0, attention_backend="reference", num_kv_blocks=64, async_scheduling=async_scheduling)
    runner = llm.llm_engine.runner
    calls = []

    def guarded(fn):
        def run(*args, **kwargs):
            calls.append(fn)
            with no_device_syncs():
                return fn(*args, **kwargs)
        return run

    runner.sampler = guarded(runner.sampler)
    runner.sampling.tensors = guarded(runner.sampling.tensors)
    score = model_runner.score_prompt_tokens
    monkeypatch.setattr(model_runner, "score_prompt_tokens", guarded(score))
    every = dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, seed=3, logprobs=2, repetition_penalty=1.2,
                 presence_penalty=0.5, frequency_penalty=0.3, logit_bias={5: 3.0, 7: -2.0}, min_tokens=3)
    params = [SamplingParams(max_tokens=8, **every), SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=2),
              SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[ab]{4,8}"), **every)]
    outs = llm.generate(["one", "two", "three"], params)
    assert [len(o.outputs[0].token_ids) for o in outs][:2] == [8, 6]
    assert len(calls) >= 2 * 7 and score in calls and outs[1].prompt_logprobs[1] is not None


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 140), chunk=st.sampled_from([1, 3, 7, 16]), parts=st.sampled_from([1, 16, 32, 256]),
       values=st.lists(st.sampled_from([0.0, 1.0, 2.0, float("-inf"), float("inf"), float("nan")]), min_size=1,
                       max_size=4), seed=st.integers(0, 2 ** 16),
       chunks=st.sampled_from([None, (64, 32, 16), (32, 16), (8,)]))
def test_row_argmax_is_argmax_ties_and_nan_included(rows, chunk, parts, values, seed, chunks):
    """The two-pass argmax of small batches gives torch.argmax's index (the first maximum; NaN the maximum), on
    rows drawn from a few values so that ties across chunks are common; with the default chunk counts or others
    (sampler.ARGMAX_CHUNKS)."""
    from flexengine.layers import sampler
    g = torch.Generator().manual_seed(seed)
    V = chunk * parts
    x = torch.tensor(values)[torch.randint(len(values), (rows, V), generator=g)]
    with pytest.MonkeyPatch.context() as m:
        if chunks is not None:
            m.setattr(sampler, "ARGMAX_CHUNKS", chunks)
        assert torch.equal(sampler.row_argmax(x), x.argmax(-1))


def test_compiled_temperature_sample_equals_eager(monkeypatch, tmp_path):
    """temperature_sample as the CUDA engine runs it, through Inductor (here on the CPU), against the eager code on
    the same noise: greedy rows, sampled rows, one row and many, within two graphs (one row; any other count)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # a cached graph brings its old guards
    from flexengine.compile import compile_count, configure_dynamo, reset_fused, set_fused_elementwise
    from flexengine.layers.sampler import temperature_sample
    torch._dynamo.reset()
    reset_fused()
    configure_dynamo()
    g = torch.Generator().manual_seed(0)
    before = compile_count()
    for n in (1, 3, 40, 7):
        logits = torch.randn(n, 1024, generator=g) * 4
        temperature = torch.where(torch.arange(n) % 3 == 0, 0.0, torch.rand(n, generator=g) + 0.3)
        q = torch.empty(n, 1024).exponential_(generator=g)
        want = temperature_sample.eager(logits, temperature, q)
        set_fused_elementwise(True)
        try:
            got = temperature_sample(logits, temperature, q)
        finally:
            set_fused_elementwise(False)
        assert torch.equal(got, want), n
        assert torch.equal(want[::3], logits[::3].argmax(-1))  # temperature 0: greedy
    assert compile_count() - before <= 2


def warmed_compiled_sampler(monkeypatch, tmp_path, V: int) -> tuple[Sampler, int]:
    """A compiled sampler (the CUDA engine's, here through Inductor's C++ backend) after Sampler.warm_up over a
    vocabulary of V, with dynamo reset and its own empty Inductor cache (a cached graph brings its old guards);
    and dynamo's graph count then."""
    from flexengine.compile import compile_count, configure_dynamo, reset_fused
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    reset_fused()
    configure_dynamo()
    sampler = Sampler(compiled=True)
    sampler.warm_up(V, "cpu")
    return sampler, compile_count()


def test_compiled_sampler_runs_one_row_on_the_graph_of_several(monkeypatch, tmp_path):
    """The CUDA engine's sampler (compiled, here on the CPU) after Sampler.warm_up, which compiles graphs of several
    rows only: one sampled row, one row with penalties, and a few rows with one penalised, draw the tokens the eager
    sampler draws from the same seed, and compile nothing."""
    from flexengine.compile import compile_count
    from flexengine.layers.sampler import LogitsAdjust
    V = 512
    _, before = warmed_compiled_sampler(monkeypatch, tmp_path, V)
    g = torch.Generator().manual_seed(1)
    for n, penalised in ((1, False), (1, True), (3, True), (1, False)):
        with torch.inference_mode():  # as the engine makes its sampling tensors (else a graph of its own)
            logits = torch.randn(n, V, generator=g) * 3
            adjust = None
            if penalised:
                tokens = torch.randint(0, V, (1, 6), generator=g)
                adjust = LogitsAdjust(None, None, torch.tensor([n - 1]), tokens, torch.ones(1, 6, dtype=torch.bool),
                                      torch.tensor([1.5]), torch.tensor([0.4]), torch.tensor([0.3]))
            t = SamplingTensors(temperature=torch.full((n,), 0.9), adjust=adjust)
            ids = {compiled: Sampler(torch.Generator().manual_seed(7), compiled=compiled)(logits.clone(), t).token_ids
                   for compiled in (True, False)}
        assert ids[True].shape == (n,) and torch.equal(ids[True], ids[False]), (n, penalised)
    assert compile_count() == before


def masked_plainly(logits, bitmask, limit):
    """The token mask written out: row n keeps id j iff j < limit[n] and either j is past the bitmask's words or
    bit j % 32 of word j // 32 of row n is set."""
    out = logits.clone()
    W = bitmask.shape[1]
    for n in range(logits.shape[0]):
        for j in range(logits.shape[1]):
            if not (j < int(limit[n]) and (j >= 32 * W or (int(bitmask[n, j // 32]) >> (j % 32)) & 1)):
                out[n, j] = float("-inf")
    return out


def token_mask(N, rows, bitmask, T):
    """The engine's TokenMask for grammar rows `rows` of N (bitmask: theirs; T: the tokenizer's ids), the other
    rows unmasked, as fill_token_mask makes it."""
    from flexengine.layers.sampler import NO_LIMIT, TokenMask
    full = torch.full((N, bitmask.shape[1]), -1, dtype=torch.int32, device=bitmask.device)
    full[rows] = bitmask
    limit = torch.full((N,), NO_LIMIT, dtype=torch.int32, device=bitmask.device)
    limit[rows] = T
    return TokenMask(full, limit)


def random_token_mask(data, N, V):
    """A TokenMask of some grammar rows (their words at random, the tokenizer's ids T ending inside the last word,
    bitmasks narrower and wider than the logits), and logits."""
    rows = sorted(data.draw(st.sets(st.integers(0, N - 1), min_size=1)))
    W = data.draw(st.integers(max(1, -(-V // 32) - 2), -(-V // 32) + 2))
    T = data.draw(st.integers(max(1, 32 * W - 31), 32 * W))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 31)))
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (len(rows), W), dtype=torch.int32, generator=g)
    return token_mask(N, rows, bitmask, T), torch.randn(N, V, generator=g)


@settings(max_examples=30, deadline=None)
@given(V=st.integers(1, 100), N=st.integers(1, 5), data=st.data())
def test_token_mask_formulations_match_the_plain_one(V, N, data):
    """Every way the sampler masks (bits unpacked to bytes on a CPU; a word per logit under Inductor, alone or
    inside the sampling kernel), run eagerly, against the plain loop."""
    from flexengine.layers.sampler import apply_token_mask, mask_by_bitmask, temperature_sample
    m, logits = random_token_mask(data, N, V)
    want = masked_plainly(logits, m.bitmask, m.limit)
    assert torch.equal(apply_token_mask(logits.clone(), m.bitmask, m.limit), want)
    assert torch.equal(mask_by_bitmask.eager(logits.clone(), m.bitmask, m.limit), want)
    temperature = torch.tensor([0.0, 1.0] * N)[:N]  # greedy rows: the masked argmax; the others: an allowed id
    ids = temperature_sample.eager(logits.clone(), temperature, torch.ones(N, V), (m.bitmask, m.limit))
    assert torch.equal(ids[::2], want[::2].argmax(-1))
    assert all(want[n, ids[n]] > float("-inf") for n in range(N) if (want[n] > float("-inf")).any())


def test_compiled_token_mask_equals_eager_and_is_warmed_up(monkeypatch, tmp_path):
    """The CUDA engine's token masks (Sampler.mask, and temperature_sample's own), through Inductor here on the
    CPU, against the CPU's eager one: a 128k vocabulary's width, padded past the tokenizer's ids, one grammar row
    or several among one sampled row or several. Sampler.warm_up compiles every graph these need (a first JSON
    request would otherwise wait for a compile)."""
    pytest.importorskip("xgrammar")  # warm_up compiles the masks only where JSON mode can run
    from flexengine.compile import compile_count, fused_elementwise
    from flexengine.layers.sampler import temperature_sample, two_rows
    g = torch.Generator().manual_seed(0)
    V, T = 32 * 4008 + 8, 32 * 4008 - 5  # logits padded past the tokenizer's ids
    sampler, before = warmed_compiled_sampler(monkeypatch, tmp_path, V)
    for n, rows in ((4, [0, 2, 3]), (1, [0]), (9, [1, 4, 5, 8]), (6, [5])):
        with torch.inference_mode():  # as the engine makes and samples them
            logits = torch.randn(n, V, generator=g)
            m = token_mask(n, rows, torch.randint(-2 ** 31, 2 ** 31 - 1, (len(rows), -(-T // 32)), dtype=torch.int32,
                                                  generator=g), T)
            want = Sampler(compiled=False).mask(logits.clone(), m)
            got = sampler.mask(logits.clone(), m)
            args = (logits.clone(), torch.zeros(n), torch.ones(n, V), m.bitmask, m.limit)
            if n == 1:  # as the sampler runs one row (on the graph of several)
                args = two_rows(*args)
            with fused_elementwise(True):
                greedy = temperature_sample(*args[:3], args[3:])[:n]
        assert torch.equal(got, want), n
        assert torch.equal(greedy, want.argmax(-1)), n
        assert torch.isinf(want[rows, T:]).all() and (want[rows] > float("-inf")).any()
        free = [r for r in range(n) if r not in rows]
        assert torch.equal(want[free], logits[free])
    assert compile_count() == before


def test_compiled_penalties_equal_eager_and_are_warmed_up(monkeypatch, tmp_path):
    """The penalties as the CUDA engine applies them (`penalise`: apply_penalties through Inductor, here on the CPU)
    against the eager code, which test_logits_processors checks against the plain formulas: one penalised row or
    several among more rows, a step of one row, short and long histories with repeated tokens; Sampler.warm_up
    compiled the one graph they all share."""
    from flexengine.compile import compile_count
    from flexengine.layers.sampler import LogitsAdjust, apply_penalties, penalise
    V = 1000
    _, before = warmed_compiled_sampler(monkeypatch, tmp_path, V)
    g = torch.Generator().manual_seed(0)
    for n, P, L in ((4, 1, 2), (6, 3, 300), (1, 1, 9), (2, 2, 7), (9, 5, 64), (2, 1, 3)):
        with torch.inference_mode():  # as the engine makes and samples them
            logits = torch.randn(n, V, generator=g) * 3
            rows = torch.randperm(n, generator=g)[:P]
            tokens = torch.randint(0, 40, (P, L), generator=g)  # a small range: tokens repeat
            is_output = torch.rand(P, L, generator=g) < 0.6
            coefficients = [torch.rand(P, generator=g) + 0.5, torch.rand(P, generator=g), torch.rand(P, generator=g) - 0.5]
            want = logits.clone()
            apply_penalties.eager(want, rows, tokens, is_output, *coefficients)
            got = penalise(logits.clone(), LogitsAdjust(None, None, rows, tokens, is_output, *coefficients), True)
        assert got.shape == (n, V)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert not torch.equal(want, logits)
    assert compile_count() == before


def test_the_engines_sampling_inputs_compile_nothing_after_warm_up(monkeypatch, tmp_path):
    """The compiled sampler (the CUDA engine's, here on the CPU) fed what the engine builds for a step
    (build_sampling_tensors, LogitsAdjuster) after Sampler.warm_up: plain, masked and penalised batches of one row
    and several compile nothing more (a strided temperature column once compiled the sampler again mid-run)."""
    pytest.importorskip("xgrammar")  # warm_up compiles the masked sampler only where JSON mode can run
    import dataclasses
    from flexengine.compile import compile_count
    from flexengine.engine.logits_adjust import LogitsAdjuster
    from flexengine.engine.sampling_inputs import build_sampling_tensors
    from flexengine.engine.sequence import Sequence
    V = 320
    sampler, before = warmed_compiled_sampler(monkeypatch, tmp_path, V)
    penalised = SamplingParams(temperature=0.8, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3,
                               logit_bias={3: 2.0})
    for n in (1, 5, 3):
        seqs = [Sequence(request_id=f"{n}-{i}", index=0, token_ids=[1, 2, 3, i], num_prompt_tokens=3,
                         params=penalised if i % 2 else SamplingParams(temperature=0.7)) for i in range(n)]
        for s in seqs:
            s.min_tokens_stops = frozenset()
        with torch.inference_mode():  # as ModelRunner.sampling_inputs and .sample run
            t = build_sampling_tensors(seqs, "cpu")
            mask = token_mask(n, [0], torch.full((1, 7), -1, dtype=torch.int32), 200)
            adjust = LogitsAdjuster(V, "cpu", 8)(seqs)
            for step in (t, dataclasses.replace(t, token_mask=mask), dataclasses.replace(t, adjust=adjust)):
                ids = sampler(torch.randn(n, V), step).token_ids
                assert ids.shape == (n,)
    assert compile_count() == before
