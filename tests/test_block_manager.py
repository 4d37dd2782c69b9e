"""Block manager: reference counts, the prefix cache and its verification, LRU eviction.

A shadow "KV cache" records, for every slot written, the whole token prefix that produced it (what
real K/V depends on). A sequence must only ever read slots whose shadow matches its own prefix: this
catches any wrong reuse, including one a hash collision would cause.
"""
import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from flexengine.engine.block_manager import BlockManager
from flexengine.engine.sequence import Sequence
from flexengine.sampling_params import SamplingParams

PARAMS = SamplingParams()


def make_seq(tokens):
    return Sequence(request_id="r", index=0, token_ids=list(tokens), num_prompt_tokens=len(tokens), params=PARAMS)


class Shadow:
    """What each physical slot holds: the token prefix that produced its K/V."""

    def __init__(self, num_blocks, block_size):
        self.P = block_size
        self.slots = [[None] * block_size for _ in range(num_blocks)]

    def compute(self, seq, n):
        """Write the K/V of seq's next n tokens, as the model runner would."""
        start = seq.num_computed_tokens
        for pos in range(start, start + n):
            self.slots[seq.block_table[pos // self.P]][pos % self.P] = tuple(seq.token_ids[:pos + 1])
        seq.num_computed_tokens += n

    def check(self, seq):
        for pos in range(seq.num_computed_tokens):
            got = self.slots[seq.block_table[pos // self.P]][pos % self.P]
            assert got == tuple(seq.token_ids[:pos + 1]), f"{seq} reads a wrong K/V at position {pos}"


def admit(bm, shadow, seq, n):
    hits = bm.cached_prefix(seq)
    n = min(n, seq.num_tokens - len(hits) * bm.block_size)
    if not bm.can_allocate(seq, n, hits):
        return False
    bm.allocate(seq, n, hits)
    shadow.check(seq)  # the hits hold exactly this sequence's prefix
    shadow.compute(seq, n)
    bm.cache_full_blocks(seq)
    return True


def test_prefix_hit_reuses_pages_and_leaves_last_token():
    bm = BlockManager(8, 4)
    shadow = Shadow(8, 4)
    a = make_seq(range(10))
    assert admit(bm, shadow, a, 10)
    assert bm.blocks[a.block_table[0]].hash is not None and bm.blocks[a.block_table[2]].hash is None
    b = make_seq(list(range(8)) + [99, 98])
    hits = bm.cached_prefix(b)
    assert hits == a.block_table[:2]
    c = make_seq(range(8))  # exactly two full pages: the last token must still be computed
    assert bm.cached_prefix(c) == a.block_table[:1]
    bm.free(a)
    assert bm.num_free_blocks() == 8
    bm.check_invariants([])


def test_collision_never_reuses_a_wrong_page():
    bm = BlockManager(8, 2, hash_fn=lambda parent, toks: 0)  # every page collides
    shadow = Shadow(8, 2)
    a = make_seq([1, 2, 3, 4, 5])
    assert admit(bm, shadow, a, 5)
    b = make_seq([1, 2, 9, 9, 5])
    assert bm.cached_prefix(b) == [a.block_table[0]]  # page 0 truly matches; page 1 collides and is refused
    c = make_seq([7, 7, 3, 4, 5])
    assert bm.cached_prefix(c) == []
    d = make_seq([9, 9, 3, 4, 5])  # page 1 tokens match a's page 1 but its prefix does not
    bm.free(a)
    assert bm.cached_prefix(d) == []
    bm.check_invariants([])


def test_lru_evicts_least_recently_released():
    bm = BlockManager(4, 2)
    shadow = Shadow(4, 2)
    a, b = make_seq([1, 2, 3]), make_seq([5, 6, 7])
    assert admit(bm, shadow, a, 3) and admit(bm, shadow, b, 3)
    a_page, b_page = a.block_table[0], b.block_table[0]
    bm.free(a)
    bm.free(b)
    c = make_seq([8, 8, 8, 8, 8, 8, 8])
    assert bm.num_free_blocks() == 4 and len(bm.evictable) == 2
    assert admit(bm, shadow, c, 5)  # 3 pages: the two free ones, then a's (released first)
    assert a_page in c.block_table and b_page not in c.block_table
    assert bm.cached_prefix(make_seq([5, 6, 7])) == [b_page]
    assert bm.cached_prefix(make_seq([1, 2, 3])) == []
    bm.check_invariants([c])


def test_prefix_caching_off():
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    shadow = Shadow(8, 2)
    a = make_seq([1, 2, 3, 4, 5])
    assert admit(bm, shadow, a, 5)
    assert bm.cached_prefix(make_seq([1, 2, 3, 4, 5])) == []
    bm.free(a)
    assert len(bm.free_ids) == 8 and not bm.evictable


class BlockManagerMachine(RuleBasedStateMachine):
    """Random sequences sharing prefixes, chunked computation, decode appends and frees on a tiny pool."""

    def __init__(self):
        super().__init__()
        self.bm = None

    @rule(num_blocks=st.integers(2, 12), block_size=st.sampled_from([1, 2, 3, 4]), caching=st.booleans(),
          weak_hash=st.booleans())
    @precondition(lambda self: self.bm is None)
    def setup(self, num_blocks, block_size, caching, weak_hash):
        hash_fn = (lambda parent, toks: sum(toks) % 3) if weak_hash else (lambda parent, toks: hash((parent, toks)))
        self.bm = BlockManager(num_blocks, block_size, caching, hash_fn=hash_fn)
        self.shadow = Shadow(num_blocks, block_size)
        self.live = []
        self.prefixes = [[1, 2, 3, 1, 2, 3, 1, 2], [1, 2, 3, 4], [2, 2, 2, 2, 2, 2]]

    @rule(prefix=st.integers(0, 2), cut=st.integers(0, 8), suffix=st.lists(st.integers(0, 3), max_size=6),
          chunk=st.integers(1, 10))
    @precondition(lambda self: self.bm is not None)
    def add(self, prefix, cut, suffix, chunk):
        tokens = self.prefixes[prefix][:cut] + suffix
        if not tokens:
            return
        seq = make_seq(tokens)
        if admit(self.bm, self.shadow, seq, chunk):
            self.live.append(seq)

    @rule(pick=st.integers(0, 100), chunk=st.integers(1, 6), token=st.integers(0, 3))
    @precondition(lambda self: self.bm is not None and self.live)
    def advance(self, pick, chunk, token):
        seq = self.live[pick % len(self.live)]
        if seq.num_uncomputed_tokens == 0:
            seq.token_ids.append(token)  # a decode step: the sampled token joins the sequence
        n = min(chunk, seq.num_uncomputed_tokens)
        if self.bm.can_allocate(seq, n):
            self.bm.allocate(seq, n)
            self.shadow.compute(seq, n)
            self.bm.cache_full_blocks(seq)

    @rule(pick=st.integers(0, 100))
    @precondition(lambda self: self.bm is not None and self.live)
    def free(self, pick):
        seq = self.live.pop(pick % len(self.live))
        self.bm.free(seq)
        assert seq.block_table == []

    @invariant()
    def consistent(self):
        if self.bm is None:
            return
        self.bm.check_invariants(self.live)
        for seq in self.live:
            self.shadow.check(seq)
        used = len({b for s in self.live for b in s.block_table})
        assert used + self.bm.num_free_blocks() == self.bm.num_blocks  # nothing leaked

    def teardown(self):
        if self.bm is not None:
            for seq in self.live:
                self.bm.free(seq)
            self.bm.check_invariants([])
            assert self.bm.num_free_blocks() == self.bm.num_blocks


BlockManagerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                                 suppress_health_check=list(HealthCheck))
TestBlockManagerMachine = BlockManagerMachine.TestCase


def test_random_sharing_smoke():
    """A plain random run with heavy sharing: hits happen and are always verified."""
    rng = random.Random(0)
    bm, shadow, live = BlockManager(16, 2), Shadow(16, 2), []
    for _ in range(300):
        if live and rng.random() < 0.3:
            bm.free(live.pop(rng.randrange(len(live))))
        else:
            seq = make_seq([1, 1, 2, 2][: rng.randint(0, 4)] + [rng.randint(0, 2) for _ in range(rng.randint(1, 5))])
            if admit(bm, shadow, seq, rng.randint(1, 9)):
                live.append(seq)
        bm.check_invariants(live)
    assert bm.num_hits > 0
