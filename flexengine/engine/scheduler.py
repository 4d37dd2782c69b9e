"""Which sequences run this step, and how many of their tokens (chunked prefill, SplitFuse style).

Each step fills a budget of `max_num_batched_tokens` tokens and `max_num_seqs` sequences:
1. running sequences, decodes first (one token each), then the next chunk of those still prefilling;
   when a running sequence cannot get a page, the newest running sequence is preempted (its pages are
   freed and it is recomputed later, resuming exactly where it was);
2. then waiting sequences in arrival order (FCFS), each with as much of its prompt as the budget
   allows, after taking whatever the prefix cache already holds. A waiting sequence that does not fit
   stops admission (FCFS: nothing behind it overtakes it).
Prefill and decode tokens share one step, prefill chunks first in the batch. A chunk that the budget
cuts short ends on a multiple of `chunk_align` tokens (the attention's query tile) where the budget
holds one. Both keep the prefill call's query tiles (the packed token buffer cut every 128 tokens,
attention/metadata.py) to one request each wherever prompts are whole tiles: such a tile skips the
mask on its full KV blocks, a tile shared by two requests evaluates it everywhere.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from operator import sub

from .block_manager import BlockManager
from .block_tables import BlockTables
from .prompt_logprobs import wants_prompt_logprobs
from .sequence import Sequence, SequenceStatus, num_computed_of, token_ids_of


def multi_step_ok(params) -> bool:
    """Multi-step decode's sampler returns no logprobs, and feeds tokens on without the host's grammar
    matcher, which must see each token before the next step's mask. (Penalties, logit_bias and min_tokens
    follow the tokens on the device: LogitsAdjuster.step_on.)"""
    return params.logprobs is None and params.structured_outputs is None


def tokens_wanted(seq: Sequence) -> float:
    """Tokens `seq` may still generate before max_tokens (inf without a limit)."""
    limit = seq.params.max_tokens
    return float("inf") if limit is None else limit - seq.num_output_tokens


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # tokens computed this step, per sequence
    preempted: list[Sequence] = field(default_factory=list)
    num_steps: int = 1  # > 1: a multi-step decode, every sequence has pages for this many tokens
    block_tables: BlockTables | None = None  # the block manager's rows of the sequences' tables (None: read the lists)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)

    def put_prefills_first(self) -> None:
        """Reorder: chunks of more than one token first (each group keeps its order)."""
        if self.num_new_tokens.count(1) in (0, len(self.num_new_tokens)):
            return  # (one group, as in most decode steps: the sort by a Python key was ~5% of schedule at 256 rows)
        order = sorted(range(len(self.seqs)), key=lambda i: self.num_new_tokens[i] == 1)
        self.seqs = [self.seqs[i] for i in order]
        self.num_new_tokens = [self.num_new_tokens[i] for i in order]


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 whole_prompts: bool = False, num_scheduler_steps: int = 1, max_model_len: int | None = None,
                 chunk_align: int = 1, workspace_tokens: int | None = None, workspace_align: int = 1):
        self.block_manager = block_manager
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        # A look-ahead mask (bidirectional, prefix-LM) lets prompt tokens see later prompt tokens, so a
        # prompt must be computed in one step: a chunk never ends inside the prompt.
        self.whole_prompts = whole_prompts
        self.num_scheduler_steps, self.max_model_len = num_scheduler_steps, max_model_len
        self.chunk_align = chunk_align
        # Compiled flex prefills from a workspace of this many tokens (attention/metadata.py): the
        # contexts of a step's prefilling requests, each rounded up to workspace_align, must fit it.
        self.workspace_tokens, self.workspace_align = workspace_tokens, workspace_align
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is the newest
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        assert seq.status is SequenceStatus.WAITING and not seq.block_table
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---------------------------------------------------------------- the step
    def schedule(self) -> ScheduledBatch:
        batch = self.schedule_multi_step()
        if batch is not None:
            return batch
        batch = ScheduledBatch(block_tables=self.block_manager.tables)
        budget = self.max_num_batched_tokens
        self._workspace_left = self.workspace_tokens
        uncomputed = list(map(sub, map(len, map(token_ids_of, self.running)), map(num_computed_of, self.running)))
        decodes = [s for s, u in zip(self.running, uncomputed) if u == 1]
        prefills = [s for s, u in zip(self.running, uncomputed) if u > 1]
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or (seq.num_pending and self.at_limit(seq)):
                continue  # preempted earlier in this loop, or its pending token is its last
            if self.decode_with_room(seq):  # most rows of most steps
                batch.seqs.append(seq)
                batch.num_new_tokens.append(1)
                budget -= 1
                continue
            n = self.chunk(seq.num_uncomputed_tokens, budget)
            if n < self.min_chunk(seq, seq.num_computed_tokens) or \
                    not self.take_prefill_room(seq.num_computed_tokens, n):
                continue  # the rest of its prompt does not fit this step
            if self.block_manager.pages_needed(seq, n) == 0:  # most decode steps: room in its last page
                batch.seqs.append(seq)
                batch.num_new_tokens.append(n)
                budget -= n
                continue
            while not self.block_manager.can_allocate(seq, n):
                victim = self.running[-1]
                budget += self._preempt(victim, batch)
                if victim is seq:
                    break
            else:
                self.block_manager.allocate(seq, n)
                batch.seqs.append(seq)
                batch.num_new_tokens.append(n)
                budget -= n
        if not batch.preempted:  # after preempting, let the freed pages go to the running ones first
            budget = self._admit_waiting(batch, budget)
        batch.put_prefills_first()
        return batch

    def schedule_multi_step(self) -> ScheduledBatch | None:
        """Every running sequence decodes for several steps, when no waiting one could be admitted
        and pages suffice.

        Steps stop short of max_model_len (a position past it has no column in the block table) and
        at the most tokens any sequence still wants; a sequence that finishes early (EOS, its own
        max_tokens) runs on and its extra tokens are dropped.
        """
        if self.num_scheduler_steps < 2 or not self.running or \
                (self.waiting and len(self.running) < self.max_num_seqs) or \
                not all(s.num_uncomputed_tokens == 1 and multi_step_ok(s.params) for s in self.running):
            return None
        k = min(self.num_scheduler_steps, max(tokens_wanted(s) for s in self.running))
        if self.max_model_len is not None:
            k = min(k, min(self.max_model_len - s.num_tokens + 1 for s in self.running))
        bm = self.block_manager
        if k < 2 or len(self.running) > self.max_num_batched_tokens or \
                sum(bm.pages_needed(s, k) for s in self.running) > bm.num_free_blocks():
            return None
        for seq in self.running:
            bm.allocate(seq, k)
        return ScheduledBatch(list(self.running), [1] * len(self.running), num_steps=k,
                              block_tables=self.block_manager.tables)

    def decode_with_room(self, seq: Sequence) -> bool:
        """Whether `seq` is a decode row with room for its token in its last page: the loop in `schedule` then
        gives it what its general path would (a chunk of 1, no prefill room, no page) with a fraction of that
        path's Python (~3 µs a request; 256 decodes scheduled in ~2x less time on the dev CPU, session 34)."""
        computed = seq.num_computed_tokens
        return computed == len(seq.token_ids) - 1 and computed < len(seq.block_table) * self.block_manager.block_size

    def at_limit(self, seq: Sequence) -> bool:
        """Whether `seq`, which holds PENDING tokens, has all the tokens it may have counting them (async scheduling:
        it finishes once they are read back, so it needs no more steps). `schedule` asks only for such sequences."""
        return seq.reaches_length_limit(seq.num_tokens, self.max_model_len)

    def chunk(self, remaining: int, budget: int) -> int:
        """Tokens to compute now of the `remaining` uncomputed ones: all if the budget allows, else the
        budget cut down to whole multiples of chunk_align (the budget itself when it holds none)."""
        if remaining <= budget:
            return remaining
        return budget - budget % self.chunk_align if budget >= self.chunk_align else budget

    def take_prefill_room(self, computed: int, n: int) -> bool:
        """Whether a chunk of n tokens after `computed` fits the step's prefill workspace; then it is taken."""
        if n == 1:
            return True  # decode rows read the pages directly
        if self.workspace_tokens is not None:
            a = self.workspace_align
            need = -(-(computed + n) // a) * a
            if need > self._workspace_left:
                return False
            self._workspace_left -= need
        return True

    def min_chunk(self, seq: Sequence, computed: int) -> int:
        """Fewest tokens a step may give `seq`: 1, or with whole prompts all of its uncomputed prompt."""
        return max(1, seq.num_prompt_tokens - computed) if self.whole_prompts else 1

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending:
                break  # preempted while its last token was in flight: recomputed once that token is known
            # prompt logprobs need every prompt token's hidden state: no cache hits for them
            hits = [] if wants_prompt_logprobs(seq) else self.block_manager.cached_prefix(seq)
            cached = len(hits) * self.block_manager.block_size
            n = self.chunk(seq.num_tokens - cached, budget)
            if n < self.min_chunk(seq, cached) or not self.block_manager.can_allocate(seq, n, hits) \
                    or not self.take_prefill_room(cached, n):
                break
            self.block_manager.allocate(seq, n, hits)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        return budget

    def _preempt(self, victim: Sequence, batch: ScheduledBatch) -> int:
        """Free the victim's pages and requeue it first in line; returns the budget it gave back."""
        refund = 0
        if victim in batch.seqs:
            i = batch.seqs.index(victim)
            batch.seqs.pop(i)
            refund = batch.num_new_tokens.pop(i)
        self.running.remove(victim)
        self.block_manager.free(victim)  # also resets num_computed_tokens: it will be recomputed
        victim.status = SequenceStatus.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        batch.preempted.append(victim)
        return refund

    def mark_launched(self, batch: ScheduledBatch) -> None:
        """The step is queued on the device: count its tokens as computed, so the next schedule moves on.
        Pages enter the prefix cache later (cache_computed), once every token in them is known."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            assert seq.num_computed_tokens <= seq.num_tokens

    def cache_computed(self, seqs: list[Sequence]) -> None:
        """After a launched step is read back: the full pages of its sequences enter the prefix cache."""
        for seq in seqs:
            if seq.status is SequenceStatus.RUNNING:
                self.block_manager.cache_full_blocks(seq)

    def mark_computed(self, seq: Sequence, n: int) -> None:
        """A multi-step decode's token by token: its K/V is in the cache, and a page it fills is cached."""
        seq.num_computed_tokens += n
        assert seq.num_computed_tokens <= seq.num_tokens
        self.block_manager.cache_full_blocks(seq)

    # ---------------------------------------------------------------- leaving
    def finish(self, seq: Sequence, reason: str) -> None:
        """Finish `seq` (a stop, a length cap, an abort) and free its pages now."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            return
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
