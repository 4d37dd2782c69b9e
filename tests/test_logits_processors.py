"""Penalties, logit_bias and min_tokens (vLLM's semantics) against the formulas written plainly: the
sampler on random histories, and greedy generation against transformers' logits step by step."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flexengine import LLM, SamplingParams
from flexengine.engine.logits_adjust import LogitsAdjuster, build_logits_adjust
from flexengine.engine.sequence import PENDING, Sequence
from flexengine.layers.sampler import apply_adjust
from sync_guard import no_device_syncs
from test_models_parity import make_checkpoint, random_prompt

V = 12


def plain_adjust(logits: list[float], prompt: list[int], output: list[int], p: SamplingParams,
                 stops: set[int]) -> list[float]:
    """vLLM's order: min_tokens bans, logit_bias, repetition (prompt + output), frequency and presence (output)."""
    x = list(logits)
    for t in range(len(x)):
        if len(output) < p.min_tokens and t in stops:
            x[t] = -math.inf
        x[t] += (p.logit_bias or {}).get(t, 0.0)
        if t in prompt or t in output:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty * (t in output)
    return x


params_st = st.builds(
    SamplingParams, max_tokens=st.just(20), presence_penalty=st.sampled_from([0.0, 0.5, -1.0, 2.0]),
    frequency_penalty=st.sampled_from([0.0, 0.3, -0.7]), repetition_penalty=st.sampled_from([1.0, 1.3, 0.8]),
    logit_bias=st.one_of(st.none(), st.dictionaries(st.integers(0, V - 1), st.floats(-5, 5), max_size=3)),
    min_tokens=st.integers(0, 4), stop_token_ids=st.lists(st.integers(0, V - 1), max_size=2))


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(rows=st.lists(st.tuples(params_st, st.lists(st.integers(0, V - 1), min_size=1, max_size=6),
                               st.lists(st.integers(0, V - 1), max_size=6)), min_size=1, max_size=4),
       seed=st.integers(0, 1000))
def test_adjust_matches_the_plain_formulas(rows, seed):
    seqs = []
    for i, (p, prompt, output) in enumerate(rows):
        seq = Sequence(request_id=str(i), index=0, token_ids=prompt + output, num_prompt_tokens=len(prompt), params=p)
        seq.min_tokens_stops = frozenset(p.stop_token_ids)
        seqs.append(seq)
    logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(seed))
    adjust = build_logits_adjust(seqs, V, "cpu")
    got = logits if adjust is None else apply_adjust(logits, adjust)
    for i, (p, prompt, output) in enumerate(rows):
        want = plain_adjust(logits[i].tolist(), prompt, output, p, set(p.stop_token_ids))
        assert got[i].tolist() == pytest.approx(want, rel=1e-5, abs=1e-5)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(rows=st.lists(st.tuples(params_st, st.lists(st.integers(0, V - 1), min_size=1, max_size=5)), min_size=1,
                     max_size=5),
       steps=st.lists(st.tuples(st.lists(st.integers(0, 4), min_size=1, max_size=3, unique=True),
                                st.lists(st.integers(0, 2), min_size=5, max_size=5),
                                st.lists(st.integers(0, V - 1), min_size=5, max_size=5), st.booleans(),
                                st.integers(0, 3)),
                      min_size=1, max_size=8),
       slots=st.integers(3, 5), seed=st.integers(0, 1000))
def test_histories_kept_on_the_device_follow_a_schedule(rows, steps, slots, seed, monkeypatch):
    """Over steps whose batches change (sequences join, leave, come back, outnumber the slots), gain 0-2
    tokens or a PENDING one whose value only the device has, the adjusted logits equal the plain formulas
    over each whole history. After a step, the same batch may run on `repeats` times with one PENDING token
    a row (async decode's steady state): those steps take the device-only path (PenaltyHistories.moved_on),
    and give the same. Nothing in a step makes the host wait for the device (it prepares these while the GPU
    runs the forward)."""
    from flexengine.engine.logits_adjust import PenaltyHistories, has_penalties
    seqs = []
    for i, (p, prompt) in enumerate(rows):
        seq = Sequence(request_id=str(i), index=0, token_ids=list(prompt), num_prompt_tokens=len(prompt), params=p)
        seq.min_tokens_stops = frozenset(p.stop_token_ids)
        seqs.append(seq)
    adjuster = LogitsAdjuster(V, "cpu", slots)
    moved_on, expected = [], 0
    monkeypatch.setattr(PenaltyHistories, "moved_on", lambda self, *a, _f=PenaltyHistories.moved_on: moved_on.append(1)
                        or _f(self, *a))
    gen = torch.Generator().manual_seed(seed)
    for picked, grow, values, wait, repeats in steps:
        batch = [seqs[i] for i in picked if i < len(seqs)][:slots]
        for k in range(1 + repeats):
            if k:  # the same batch, one PENDING token on
                grow, wait, values = [0] * 5, True, values[1:] + values[:1]
                expected += any(has_penalties(s.params) for s in batch)
            truth = {}  # row → the value of its PENDING token
            for row, seq in enumerate(batch):
                seq.token_ids += [values[(row + j) % 5] for j in range(grow[row])]
                if wait:
                    seq.token_ids.append(PENDING)
                    seq.num_pending, truth[row] = 1, values[row]
            pending = None
            if truth:
                ids = torch.tensor([truth[r] for r in sorted(truth)])
                pending = (None, ids) if len(truth) == len(batch) and seed % 2 else (torch.tensor(sorted(truth)), ids)
            logits = torch.randn(len(batch), V, generator=gen)
            with no_device_syncs():
                adjust = adjuster(batch, pending)
                got = logits if adjust is None else apply_adjust(logits, adjust)
            for row, seq in enumerate(batch):  # the step's output arrives: PENDING becomes its value
                if row in truth:
                    seq.token_ids[-1], seq.num_pending = truth[row], 0
                p = seq.params
                prompt, output = seq.token_ids[:seq.num_prompt_tokens], seq.token_ids[seq.num_prompt_tokens:]
                want = plain_adjust(logits[row].tolist(), prompt, output, p, set(p.stop_token_ids))
                assert got[row].tolist() == pytest.approx(want, rel=1e-5, abs=1e-5), (row, seq.token_ids)
    assert len(moved_on) >= expected  # every repeat (and an original step that happens to be one)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_checkpoint("llama", tmp_path_factory.mktemp("lp"))


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_with_processors_matches_transformers_step_by_step(llama, overlap):
    hf, path = llama
    llm = LLM(path, dtype="float32", block_size=4, num_kv_blocks=64, async_scheduling=overlap)
    prompt = random_prompt(9, seed=3)
    first = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0),
                         use_tqdm=False)[0].outputs[0].token_ids[0]
    stop = (first + 1) % 300
    cases = [SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.6, frequency_penalty=0.9,
                            presence_penalty=0.4, logit_bias={first: -3.0, 7: 1.5}),
             # the bias makes `first` the likeliest until the penalties of its own repeats outweigh it: the
             # token just sampled (still PENDING with async scheduling) must count at once
             SamplingParams(temperature=0, max_tokens=8, logit_bias={first: 4.0}, presence_penalty=2.0,
                            frequency_penalty=1.5),
             # min_tokens holds back a stop token the bias makes the likeliest: it comes 4th and stops
             SamplingParams(temperature=0, max_tokens=10, min_tokens=3, stop_token_ids=[stop], logit_bias={stop: 60.0})]
    outs = llm.generate([{"prompt_token_ids": prompt}] * len(cases), cases, use_tqdm=False)
    for p, out in zip(cases, outs):
        tokens, output = list(prompt), []
        with torch.no_grad():
            while len(output) < p.max_tokens:
                logits = hf(torch.tensor([tokens])).logits[0, -1].float().tolist()
                t = max(range(len(logits)), key=plain_adjust(logits, prompt, output, p, set(p.stop_token_ids)).__getitem__)
                output.append(t)  # a stop token ends the output, and is its last token id (vLLM's way)
                tokens.append(t)
                if t in p.stop_token_ids:
                    break
        assert out.outputs[0].token_ids == output
    assert outs[2].outputs[0].finish_reason == "stop" and outs[2].outputs[0].token_ids[3:] == [stop]
    assert llm.llm_engine.num_free_blocks() == llm.llm_engine.num_total_blocks


@pytest.mark.parametrize("field, value", [("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
                                          ("logit_bias", {1: 101}), ("logit_bias", {-1: 1.0}), ("min_tokens", -1),
                                          ("min_tokens", 17)])
def test_bad_values_name_their_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(max_tokens=16, **{field: value})


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(rows=st.lists(st.tuples(params_st, st.lists(st.integers(0, V - 1), min_size=1, max_size=5)), min_size=1,
                     max_size=4),
       passes=st.lists(st.lists(st.lists(st.integers(0, V - 1), min_size=4, max_size=4), min_size=1, max_size=4),
                       min_size=1, max_size=3),
       seed=st.integers(0, 1000))
def test_multi_step_passes_follow_the_sampled_tokens(rows, passes, seed):
    """Multi-step passes (LogitsAdjuster.step_on): step k of a pass sees the tokens steps 0..k-1 sampled, which
    only the device has, in its penalties and min_tokens, as the plain formulas over the grown history; the
    host's copies arrive after the pass, and the next pass goes on from them."""
    seqs = []
    for i, (p, prompt) in enumerate(rows):
        seq = Sequence(request_id=str(i), index=0, token_ids=list(prompt), num_prompt_tokens=len(prompt), params=p)
        seq.min_tokens_stops = frozenset(p.stop_token_ids)
        seqs.append(seq)
    adjuster = LogitsAdjuster(V, "cpu", len(seqs))
    gen = torch.Generator().manual_seed(seed)
    for steps in passes:  # each: the tokens step k samples, per row
        sampled = []
        for k, tokens in enumerate(steps):
            with no_device_syncs():  # (the runner steps on only where a row adjusts its logits)
                if k == 0 or not any(s.params.adjusts_logits for s in seqs):
                    adjust = adjuster(seqs) if k == 0 else None
                else:
                    adjust = adjuster.step_on(seqs, torch.tensor(sampled[-1]), k)
            logits = torch.randn(len(seqs), V, generator=gen)
            got = logits if adjust is None else apply_adjust(logits, adjust)
            for row, seq in enumerate(seqs):
                p = seq.params
                history = seq.token_ids + [s[row] for s in sampled]
                prompt, output = history[:seq.num_prompt_tokens], history[seq.num_prompt_tokens:]
                want = plain_adjust(logits[row].tolist(), prompt, output, p, set(p.stop_token_ids))
                assert got[row].tolist() == pytest.approx(want, rel=1e-5, abs=1e-5), (row, k, history)
            sampled.append(tokens[:len(seqs)] + [0] * (len(seqs) - len(tokens)))
        for row, seq in enumerate(seqs):  # the pass's tokens reach the host
            seq.token_ids += [s[row] for s in sampled]
