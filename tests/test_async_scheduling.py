"""Async scheduling (each step launched before the last one's tokens are read back) changes nothing a
user sees: transformers' greedy tokens, and, for random traffic with stops, seeds, logprobs, n > 1,
streaming deltas, aborts, invalid requests and preemption, the very outputs of the engine without it.
Every KV page comes back."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import numpy as np
import pytest

from flexengine import LLM, SamplingParams
from flexengine.config import EngineConfig
from flexengine.engine.llm_engine import LLMEngine
from flexengine.engine.sequence import PENDING
from test_engine import GREEDY, MIXED, VOCAB, assert_parity, checkpoint, prompts_of

STOP_IDS = prompts_of([25], seed=11)[0]  # a tenth of the vocabulary: sequences often stop early


def test_greedy_parity_with_transformers():
    _, path = checkpoint()
    assert_parity(LLM(path, num_kv_blocks=32, async_scheduling=True), MIXED)


def test_chunks_sliding_window_and_preemption():
    _, path = checkpoint("mistral")
    llm = LLM(path, num_kv_blocks=24, block_size=8, max_num_batched_tokens=8, async_scheduling=True)
    assert_parity(llm, prompts_of([1, 7, 17, 26]), arch="mistral")
    _, path = checkpoint()
    llm = LLM(path, num_kv_blocks=10, block_size=4, max_model_len=40, async_scheduling=True)
    assert_parity(llm, prompts_of([21, 12, 17, 8, 10]))
    assert llm.llm_engine.scheduler.num_preemptions > 0


def test_excludes_multi_step():
    with pytest.raises(ValueError, match="async_scheduling and num_scheduler_steps=4"):
        EngineConfig(async_scheduling=True, num_scheduler_steps=4)
    EngineConfig(async_scheduling=None, num_scheduler_steps=4)  # automatic: it steps aside
    with pytest.raises(ValueError, match="async_scheduling must be True, False or None"):
        EngineConfig(async_scheduling="yes")


def test_automatic_setting_turns_it_on_for_a_gpu_only():
    """None (the default of LLM, the benchmarks and the server, as vLLM's) turns async scheduling on for a CUDA
    device without multi-step."""
    import argparse
    import inspect

    from flexengine.benchmarks.common import add_engine_arguments
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert EngineConfig().async_scheduling is None and parser.parse_args([]).async_scheduling is None
    assert inspect.signature(LLM).parameters["async_scheduling"].default is None
    from flexengine.engine.llm_engine import resolve_async_scheduling
    assert resolve_async_scheduling(None, "cuda", 1) and not resolve_async_scheduling(None, "cuda", 4)
    assert not resolve_async_scheduling(None, "cpu", 1)
    assert resolve_async_scheduling(True, "cpu", 1) and not resolve_async_scheduling(False, "cuda", 1)
    assert not LLMEngine(EngineConfig(num_kv_blocks=16, async_scheduling=None)).async_scheduling  # on CPU


def test_a_stopped_sequence_drops_the_token_of_the_step_in_flight():
    """The step after the stop is already launched when the stop is seen: its token must not show."""
    _, path = checkpoint()
    engine = LLMEngine(EngineConfig(model=path, num_kv_blocks=16, async_scheduling=True))
    prompt = {"prompt_token_ids": MIXED[2]}
    full = LLM(path, num_kv_blocks=16).generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[full[2]]))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    seq_tokens = outs[-1].outputs[0].token_ids
    assert seq_tokens == full[:full.index(full[2]) + 1] and outs[-1].outputs[0].finish_reason == "stop"
    assert PENDING not in seq_tokens and engine.num_free_blocks() == engine.num_total_blocks


request_st = st.fixed_dictionaries({
    "length": st.integers(1, 30),
    "max_tokens": st.integers(1, 10),
    "kind": st.sampled_from(["greedy", "seeded", "logprobs", "n2"]),
    "stops": st.booleans(),
    "delta": st.booleans(),
    "arrival": st.integers(0, 5),
    "abort_at": st.one_of(st.none(), st.integers(0, 12)),
})


def sampling_of(r: dict, i: int) -> SamplingParams:
    kw = dict(max_tokens=r["max_tokens"], stop_token_ids=STOP_IDS if r["stops"] else None)
    if r["kind"] == "greedy":
        return SamplingParams(temperature=0, **kw)
    if r["kind"] == "logprobs":
        return SamplingParams(temperature=0, logprobs=3, **kw)
    return SamplingParams(temperature=0.9, seed=100 + i, n=2 if r["kind"] == "n2" else 1, **kw)


def drive(path: str, requests: list[dict], config: dict, async_scheduling: bool, rows: bool = False) -> dict:
    """Run the traffic to the end; → {request id: [(token ids, text, finish reason, logprobs)] per completion}
    for the requests not aborted. Delta outputs are joined, so both kinds compare alike. rows: every
    request streams, and the engine steps with step_deltas() (as the server's engine loop does)."""
    engine = LLMEngine(EngineConfig(model=path, async_scheduling=async_scheduling, **config))
    prompts = prompts_of([r["length"] for r in requests], seed=5)
    seen: dict[str, dict[int, tuple]] = {}
    step = 0
    while step <= 5 or engine.has_unfinished_requests():
        for i, r in enumerate(requests):
            if r["arrival"] == step:
                engine.add_request(str(i), {"prompt_token_ids": prompts[i]}, sampling_of(r, i),
                                   delta=r["delta"] or rows)
                with pytest.raises(ValueError, match="outside the vocabulary"):  # changes nothing
                    engine.add_request("bad", {"prompt_token_ids": [VOCAB]}, GREEDY)
            if r["abort_at"] == step:
                engine.abort_request(str(i))
        got = [(row.request_id, row) for row in engine.step_deltas()] if rows else \
            [(out.request_id, c) for out in engine.step() for c in out.outputs]
        for rid, c in got:
            completions = seen.setdefault(rid, {})
            new = (c.token_ids, c.text, c.finish_reason, c.logprobs or [])
            old = completions.get(c.index)
            if (rows or requests[int(rid)]["delta"]) and old is not None:
                new = (old[0] + new[0], old[1] + new[1], new[2], old[3] + new[3])
            completions[c.index] = new
        step += 1
    assert engine.num_free_blocks() == engine.num_total_blocks and not engine.requests
    return {rid: got for rid, got in seen.items() if requests[int(rid)]["abort_at"] is None}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(request_st, min_size=1, max_size=6),
       config=st.fixed_dictionaries({
           "num_kv_blocks": st.integers(12, 40), "block_size": st.sampled_from([4, 8]),
           "max_num_seqs": st.integers(1, 4), "max_num_batched_tokens": st.sampled_from([8, 16, 64]),
           "enable_prefix_caching": st.booleans()}), rows=st.booleans())
def test_random_traffic_same_outputs_as_without(requests, config, rows):
    """rows: the async engine streams everything through step_deltas(), the server's way."""
    _, path = checkpoint()
    config["max_model_len"] = 40  # the longest prompt and output
    sync = drive(path, requests, config, async_scheduling=False)
    got = drive(path, requests, config, async_scheduling=True, rows=rows)
    assert {rid: {i: c[:3] for i, c in cs.items()} for rid, cs in got.items()} == \
           {rid: {i: c[:3] for i, c in cs.items()} for rid, cs in sync.items()}  # tokens, text, finish reason
    for rid, completions in sync.items():
        for i, (tokens, _, reason, logprobs) in completions.items():
            assert PENDING not in tokens and reason in ("stop", "length")
            # Other batches, other float rounding: the same entries, values equal to float32 precision.
            for ours, theirs in zip(got[rid][i][3], logprobs):
                assert ours.keys() == theirs.keys()
                assert [e.logprob for e in ours.values()] == pytest.approx([e.logprob for e in theirs.values()],
                                                                           rel=1e-5)


def test_graph_shaped_engine_same_tokens_as_without(gpu_shaped_engines):
    """The CUDA engine's path (decode graphs, graphs for steps with prompts, run eagerly on CPU): the
    pending tokens are fed into the static buffers. Seeded sampling and EOS stops mid-run give exactly
    the tokens of the engine without async scheduling, with no page left and no recompile."""
    from flexengine.compile import compile_count
    from test_cuda_graphs import mixed_traffic
    prompts, params = mixed_traffic(n=10, max_len=60, max_tokens=30, temperature=0.8, top_k=20)
    for i, p in enumerate(params):
        p.seed, p.ignore_eos = i, False
    results = {}
    for overlap in (False, True):
        llm = LLM(max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=48, max_model_len=64,
                  async_scheduling=overlap)
        engine = llm.llm_engine
        assert engine.runner.decode_graphs is not None and engine.runner.mixed_graphs is not None
        engine.eos_token_ids = frozenset(range(97, 104))  # a-g: some requests stop early
        before = compile_count()
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert compile_count() == before
        assert engine.num_free_blocks() == engine.num_total_blocks
        results[overlap] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text) for o in outs]
    assert results[True] == results[False]
    assert {r for _, r, _ in results[False]} == {"stop", "length"}


def test_steady_decode_path_changes_no_token(gpu_shaped_engines, monkeypatch):
    """With async scheduling (pending tokens fed on the device), decode steps that only send their changes
    (engine/decode_inputs.py), also where requests stopped (each row gathered from its place in the last batch, fed
    the sample there), give the tokens of steps that pack the whole batch every time."""
    from flexengine.engine.decode_inputs import DecodeTracker
    from test_cuda_graphs import mixed_traffic
    prompts, params = mixed_traffic(n=10, max_len=60, max_tokens=30, temperature=0.8, top_k=20)
    for i, p in enumerate(params):
        p.seed, p.ignore_eos = i, False
    outs, moved = {}, []
    for steady in (True, False):
        if not steady:
            next_step = DecodeTracker.next_step
            monkeypatch.setattr(DecodeTracker, "next_step", lambda self, seqs: next_step(self, seqs) and None)
        llm = LLM(max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=48, max_model_len=64, async_scheduling=True)
        graphs = llm.llm_engine.runner.decode_graphs
        run_moved_on = graphs.run_moved_on
        graphs.run_moved_on = lambda *a: moved.append((steady, len(a) > 2 and a[2] is not None)) or run_moved_on(*a)
        outs[steady] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert moved and {s for s, _ in moved} == {True}  # the steady path ran, and only where it was on
    assert any(gathered for _, gathered in moved), "no step gathered its rows after a request stopped"
    assert outs[True] == outs[False]


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_feed_gives_each_waiting_row_its_sample(data):
    """InFlightStep.feed: which rows of the next step take a sample of the step in flight, and which sample,
    against a plain walk over the rows' pending counts; the same batch in order is the leading rows, with no index at
    all. Sequences hold BlockTables rows, as the engine's do: one of the step's that finished since gave its row back,
    and a new sequence may hold it now (with nothing pending); dummies without rows (warm-up) take the walk itself."""
    import types

    import torch

    from flexengine.engine.in_flight import InFlightStep
    from flexengine.engine.sequence import NO_ROW
    free = data.draw(st.permutations(list(range(40))))
    prev = [types.SimpleNamespace(seq_id=100 + i, num_pending=1, table_row=free.pop())
            for i in range(data.draw(st.integers(1, 12)))]
    out = types.SimpleNamespace(token_ids=torch.arange(len(prev)) * 10 + 7)
    step = InFlightStep(None, prev, out, [], None, {s.seq_id: i for i, s in enumerate(prev)})
    assert step.feed(list(prev), None, "cpu")[0] is None  # a decode step of the same batch
    # a changed batch: some of the sequences, in any order (the others finished: their rows are free again), and new
    # ones, on free rows or on the finished ones' (or, for the dummies' case, on none)
    kept = data.draw(st.permutations(prev))[: data.draw(st.integers(0, len(prev)))]
    for s in prev:
        if s not in kept:
            free.append(s.table_row)
            s.table_row, s.num_pending = NO_ROW, 0
    dummies = data.draw(st.booleans())
    new = [types.SimpleNamespace(seq_id=1000 + i, num_pending=0, table_row=NO_ROW if dummies else free.pop())
           for i in range(data.draw(st.integers(0, 3)))]
    seqs = data.draw(st.permutations(kept + new))
    last_rows = None if data.draw(st.booleans()) else sorted(data.draw(st.sets(st.integers(0, 50), min_size=len(seqs),
                                                                                max_size=len(seqs))))
    rows_of = range(len(seqs)) if last_rows is None else last_rows
    want = [(row, prev.index(s) * 10 + 7) for s, row in zip(seqs, rows_of) if s.num_pending]
    given_rows = None if dummies or data.draw(st.booleans()) else np.array([s.table_row for s in seqs], dtype=np.int64)
    fed = step.feed(seqs, last_rows, "cpu", given_rows)
    if not want:
        assert fed is None
    elif fed[0] is None:  # only when the batch is the step's own, in order, every row waiting
        assert seqs == prev and all(s.num_pending for s in seqs) and fed[1] is out.token_ids
    else:
        assert list(zip(fed[0].tolist(), fed[1].tolist())) == want
