"""Scheduler: budgets, decode-first packing, chunked prefill, preemption and recompute, with a simulated model.

The simulated model writes a shadow K/V (the token prefix each slot was computed from) and "samples" a
token that depends only on the sequence and its length, so a preempted and recomputed sequence must
end with exactly the tokens it would have had without preemption.
"""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from flexengine.engine.block_manager import BlockManager
from flexengine.engine.scheduler import Scheduler
from flexengine.engine.sequence import Sequence, SequenceStatus
from flexengine.sampling_params import SamplingParams
from test_block_manager import Shadow


def fake_token(seq):
    return (seq.token_ids[0] * 7 + seq.num_tokens * 3) % 5


class Sim:
    """Scheduler + block manager + a fake model runner."""

    def __init__(self, num_blocks, block_size, max_num_seqs, max_tokens_per_step, caching=True, chunk_align=1,
                 workspace_tokens=None, workspace_align=1):
        self.bm = BlockManager(num_blocks, block_size, caching)
        self.sched = Scheduler(self.bm, max_num_seqs, max_tokens_per_step, chunk_align=chunk_align,
                               workspace_tokens=workspace_tokens, workspace_align=workspace_align)
        self.shadow = Shadow(num_blocks, block_size)
        self.max_model_len = num_blocks * block_size
        self.targets = {}
        self.finished = []
        self.last_batch = None

    def add(self, prompt, max_new):
        seq = Sequence(request_id=str(len(self.targets)), index=0, token_ids=list(prompt),
                       num_prompt_tokens=len(prompt), params=SamplingParams())
        # As the engine: stop at max_model_len, but a prompt that fills it still gets one token.
        self.targets[seq.seq_id] = max(min(len(prompt) + max_new, self.max_model_len), len(prompt) + 1)
        self.sched.add(seq)
        return seq

    def step(self):
        running_before = list(self.sched.running)
        batch = self.sched.schedule()
        self.last_batch = batch
        assert batch.num_tokens <= self.sched.max_num_batched_tokens
        assert len(self.sched.running) <= self.sched.max_num_seqs
        assert len(set(map(id, batch.seqs))) == len(batch.seqs)
        # Decodes have priority: a prefill chunk of a running sequence only runs if every decode ran.
        decodes = [s for s in running_before if s.status is SequenceStatus.RUNNING and s.num_uncomputed_tokens == 1]
        prefilling = [s for s in batch.seqs if s in running_before and s.num_uncomputed_tokens > 1]
        if prefilling:
            assert all(s in batch.seqs for s in decodes)
        for seq in batch.preempted:
            assert seq.status is SequenceStatus.WAITING and seq.block_table == [] and seq not in batch.seqs
        if self.sched.workspace_tokens is not None:  # the prefill contexts fit the workspace
            a = self.sched.workspace_align
            used = sum(-(-(s.num_computed_tokens + n) // a) * a for s, n in zip(batch.seqs, batch.num_new_tokens) if n > 1)
            assert used <= self.sched.workspace_tokens, (used, self.sched.workspace_tokens)
        align = self.sched.chunk_align
        chunks = [n > 1 for n in batch.num_new_tokens]  # prefill chunks first (the prefill call's tiles)
        assert chunks == sorted(chunks, reverse=True), batch.num_new_tokens
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            assert seq.status is SequenceStatus.RUNNING and n >= 1
            if n < seq.num_uncomputed_tokens:  # a chunk cut short ends on whole tiles, if it holds one
                assert n % align == 0 or n < align, (n, align)
            assert len(seq.block_table) * self.bm.block_size >= seq.num_computed_tokens + n
            self.shadow.check(seq)  # prefix-cache hits hold this sequence's own prefix
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                self.shadow.slots[seq.block_table[pos // self.bm.block_size]][pos % self.bm.block_size] = \
                    tuple(seq.token_ids[:pos + 1])
        self.sched.mark_launched(batch)  # the engine's order: launch, then cache the computed pages
        self.sched.cache_computed(batch.seqs)
        for seq in batch.seqs:
            if seq.num_computed_tokens == seq.num_tokens:  # prompt done: sample
                seq.token_ids.append(fake_token(seq))
                if seq.num_tokens >= self.targets[seq.seq_id]:
                    self.sched.finish(seq, "length")
                    self.finished.append(seq)
        return batch

    def check(self):
        live = self.sched.running
        self.bm.check_invariants(live)
        for seq in live:
            assert seq.status is SequenceStatus.RUNNING
            self.shadow.check(seq)
        for seq in self.sched.waiting:
            assert seq.status is SequenceStatus.WAITING and seq.block_table == [] and seq.num_computed_tokens == 0
        used = len({b for s in live for b in s.block_table})
        assert used + self.bm.num_free_blocks() == self.bm.num_blocks

    def drain(self, max_steps=2000):
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return
            self.step()
            self.check()
        raise AssertionError("requests never finished (livelock or starvation)")


def expected_tokens(prompt, target):
    seq = Sequence(request_id="x", index=0, token_ids=list(prompt), num_prompt_tokens=len(prompt),
                   params=SamplingParams())
    while seq.num_tokens < target:
        seq.token_ids.append(fake_token(seq))
    return seq.token_ids


def test_chunked_prefill_and_mixed_step():
    sim = Sim(num_blocks=64, block_size=4, max_num_seqs=8, max_tokens_per_step=8)
    a = sim.add(list(range(20)), 4)
    batch = sim.step()
    assert batch.num_new_tokens == [8] and a.num_computed_tokens == 8 and a.num_output_tokens == 0
    sim.step()
    batch = sim.step()  # the last 4 prompt tokens, then a new request fills the rest of the budget
    b = sim.add([1, 2, 3, 4, 5, 6, 7, 8, 9], 3)
    batch = sim.step()  # a decodes (1 token) + 7 tokens of b's prompt; the prefill chunk goes first
    assert batch.seqs == [b, a] and batch.num_new_tokens == [7, 1]
    sim.drain()
    assert a.token_ids == expected_tokens(range(20), 24)


def test_chunk_cut_by_the_budget_ends_on_whole_tiles():
    sim = Sim(num_blocks=64, block_size=4, max_num_seqs=8, max_tokens_per_step=10, chunk_align=4)
    a = sim.add(list(range(21)), 2)
    assert sim.step().num_new_tokens == [8]  # not 10: the chunk ends on a tile boundary
    b = sim.add([1, 2, 3], 2)
    batch = sim.step()  # a's next 8; the 2 left hold no tile, so b gets them
    assert batch.seqs == [a, b] and batch.num_new_tokens == [8, 2]
    batch = sim.step()  # a's last 5, then b's last prompt token (one token, as a decode)
    assert batch.seqs == [a, b] and batch.num_new_tokens == [5, 1]
    c = sim.add(list(range(30)), 1)
    batch = sim.step()  # two decodes leave 8: c's chunk is two whole tiles
    assert batch.seqs == [c, a, b] and batch.num_new_tokens == [8, 1, 1]
    sim.drain()
    assert a.token_ids == expected_tokens(range(21), 23)


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.sim = None
        self.prompts = {}

    @rule(num_blocks=st.integers(3, 12), block_size=st.sampled_from([1, 2, 4]), max_num_seqs=st.integers(1, 5),
          budget=st.integers(1, 12), caching=st.booleans(), chunk_align=st.sampled_from([1, 3, 4]))
    @precondition(lambda self: self.sim is None)
    def setup(self, num_blocks, block_size, max_num_seqs, budget, caching, chunk_align):
        self.sim = Sim(num_blocks, block_size, max_num_seqs, budget, caching, chunk_align)

    @rule(prefix=st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 1, 2, 3, 4], [3, 3]]),
          suffix=st.lists(st.integers(0, 4), max_size=5), max_new=st.integers(1, 6))
    @precondition(lambda self: self.sim is not None)
    def add(self, prefix, suffix, max_new):
        prompt = (prefix + suffix)[: self.sim.max_model_len]
        if prompt:
            seq = self.sim.add(prompt, max_new)
            self.prompts[seq.seq_id] = (prompt, self.sim.targets[seq.seq_id], seq)

    @rule()
    @precondition(lambda self: self.sim is not None and self.sim.sched.has_unfinished())
    def step(self):
        self.sim.step()

    @rule(pick=st.integers(0, 100))
    @precondition(lambda self: self.sim is not None and self.sim.sched.has_unfinished())
    def abort(self, pick):
        live = list(self.sim.sched.running) + list(self.sim.sched.waiting)
        seq = live[pick % len(live)]
        self.sim.sched.finish(seq, "abort")
        assert seq.block_table == [] and seq.is_finished
        del self.prompts[seq.seq_id]

    @invariant()
    def consistent(self):
        if self.sim is not None:
            self.sim.check()

    def teardown(self):
        if self.sim is None:
            return
        self.sim.drain()
        for prompt, target, seq in self.prompts.values():
            assert seq.token_ids == expected_tokens(prompt, target)
        assert self.sim.bm.num_free_blocks() == self.sim.bm.num_blocks


SchedulerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                              suppress_health_check=list(HealthCheck))
TestSchedulerMachine = SchedulerMachine.TestCase


def decoding(sched, n, name, **params):
    """A running sequence of n tokens whose first n - 1 have K/V: it decodes next."""
    seq = Sequence(request_id=name, index=0, token_ids=[1] * n, num_prompt_tokens=n - 1,
                   params=SamplingParams(**params))
    sched.block_manager.allocate(seq, n - 1)
    seq.num_computed_tokens, seq.status = n - 1, SequenceStatus.RUNNING
    sched.running.append(seq)
    return seq


def test_multi_step_only_for_pure_decode_with_pages_to_spare():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, num_scheduler_steps=4, max_model_len=24)
    a, b = decoding(sched, 5, "a"), decoding(sched, 9, "b")  # 1 + 2 pages
    batch = sched.schedule()
    assert batch.num_steps == 4 and batch.num_new_tokens == [1, 1]
    assert (len(a.block_table), len(b.block_table)) == (2, 3)  # positions up to 7 and 11
    sched.add(Sequence(request_id="c", index=0, token_ids=[2] * 3, num_prompt_tokens=3, params=SamplingParams()))
    assert sched.schedule().num_steps == 1  # c waits: one step, which admits it


def test_multi_step_runs_while_the_waiting_cannot_be_admitted_and_for_the_tokens_wanted():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64, num_scheduler_steps=8)
    decoding(sched, 5, "a", max_tokens=4)
    decoding(sched, 5, "b", max_tokens=3)  # one output token so far each: 3 and 2 more wanted
    sched.add(Sequence(request_id="c", index=0, token_ids=[2] * 3, num_prompt_tokens=3, params=SamplingParams()))
    batch = sched.schedule()  # c waits, but max_num_seqs are running
    assert batch.num_steps == 3 and len(batch.seqs) == 2


@pytest.mark.parametrize("params, steps", [(dict(logprobs=2), 1), (dict(attention_params={"x": 0.5}), 8)])
def test_multi_step_only_where_its_sampler_serves(params, steps):
    """Logprobs need the one-step sampler; float attention parameters run on the graphs like any other."""
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64, num_scheduler_steps=8)
    decoding(sched, 5, "a")
    decoding(sched, 5, "b", **params)
    assert sched.schedule().num_steps == steps


def test_multi_step_needs_spare_pages_and_stops_short_of_max_model_len():
    bm = BlockManager(num_blocks=3, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, num_scheduler_steps=8, max_model_len=12)
    a = decoding(sched, 9, "a")  # 2 pages of 3; 8 steps would compute positions 8..15
    batch = sched.schedule()
    assert batch.num_steps == 4 and len(a.block_table) == 3  # positions 8..11: max_model_len is 12

    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, num_scheduler_steps=8)
    a, b = decoding(sched, 5, "a"), decoding(sched, 5, "b")  # a page each, two free; 8 steps need 4 more
    batch = sched.schedule()
    assert batch.num_steps == 1 and batch.seqs == [a, b]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 4), min_size=1, max_size=20), st.integers(1, 12)), min_size=1,
                max_size=10),
       st.integers(6, 24), st.sampled_from([2, 4]), st.integers(3, 24), st.integers(1, 6), st.booleans())
def test_the_decode_fast_path_schedules_what_the_general_path_does(requests, num_blocks, block_size, budget, max_seqs,
                                                                   caching):
    """Scheduler.decode_with_room's rows (a decode with room in its last page) skip the general path's chunk, prefill
    room and page checks: every step, preemption and finish must come out the same with it turned off."""
    runs = []
    for fast in (True, False):
        sim = Sim(num_blocks, block_size, max_seqs, budget, caching)
        if not fast:
            sim.sched.decode_with_room = lambda seq: False
        for prompt, new in requests:
            sim.add(prompt, new)
        steps = []
        for _ in range(400):
            if not sim.sched.has_unfinished():
                break
            batch = sim.step()
            steps.append(([s.request_id for s in batch.seqs], batch.num_new_tokens,
                          [s.request_id for s in batch.preempted]))
        runs.append((steps, sorted((s.request_id, s.token_ids) for s in sim.finished)))
    assert runs[0] == runs[1]
