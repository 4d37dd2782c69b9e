"""KV pages: reference counts, and the prefix cache (a hash chain over full pages, verified on every hit).

A page is in exactly one state:
- free: unreferenced, holds nothing reusable;
- cached and evictable: unreferenced, but its content is still findable through the prefix cache;
  evicted least-recently-released first when a new page is needed;
- used: ref_count > 0 (several sequences may share a cached page).

The hash of page i is hash(hash of page i-1, page i's token ids). A hit must also match the stored
token ids and the stored parent's serial (a number given to each cached content once, never reused),
so by induction the whole prefix is verified and a hash collision can never hand out a wrong page.
Only full pages whose K/V is computed are cached; a partially filled last page is never shared, and a
cached page sits at the same logical index in every sequence that uses it.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Iterable

from .block_tables import BlockTables
from .sequence import NO_ROW, PENDING, Sequence

BROKEN = -1  # chain_serial of a sequence whose hash chain hit a collision: cache none of its later pages


def default_block_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None                  # set while the page is in the prefix cache
    token_ids: tuple[int, ...] | None = None
    serial: int | None = None
    parent_serial: int | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_fn: Callable[[int | None, tuple[int, ...]], int] = default_block_hash):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # oldest release first
        self.hash_to_block: dict[int, int] = {}
        self._serials = itertools.count()
        self.num_hits = 0  # pages reused through the prefix cache (for stats and tests)
        self.tables = BlockTables()  # every sequence's block table again, as rows of one array (for the steps)

    # ---------------------------------------------------------------- accounting
    def num_free_blocks(self) -> int:
        """Pages a new allocation can take: free or evictable."""
        return len(self.free_ids) + len(self.evictable)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---------------------------------------------------------------- prefix cache lookup
    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The longest verified chain of cached pages for a sequence that holds no pages yet.

        At least one token is left uncached, because the model must run on it to produce logits.
        """
        assert not seq.block_table, "only a sequence without pages looks up the prefix cache"
        if not self.enable_prefix_caching:
            return []
        P, hits = self.block_size, []
        parent_hash, parent_serial = None, None
        for i in range((seq.num_tokens - 1) // P):
            tokens = tuple(seq.token_ids[i * P:(i + 1) * P])
            h = self.hash_fn(parent_hash, tokens)
            bid = self.hash_to_block.get(h)
            if bid is None:
                break
            block = self.blocks[bid]
            if block.token_ids != tokens or block.parent_serial != parent_serial:
                break  # a hash collision: the page holds something else
            hits.append(bid)
            parent_hash, parent_serial = h, block.serial
        return hits

    # ---------------------------------------------------------------- allocation
    def _new_pages_needed(self, seq: Sequence, num_new_tokens: int, hits: list[int]) -> int:
        total = seq.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        return max(0, self.blocks_for(total) - len(seq.block_table) - len(hits))

    def pages_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """New pages `seq` needs for `num_new_tokens` more tokens (no prefix-cache hits)."""
        return self._new_pages_needed(seq, num_new_tokens, [])

    def can_allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int] = ()) -> bool:
        """Whether `seq` can get pages for `num_new_tokens` more tokens (after taking `hits`)."""
        hits = list(hits)
        # Taking an unreferenced cached hit removes it from the evictable pool.
        taken = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return self._new_pages_needed(seq, num_new_tokens, hits) <= self.num_free_blocks() - taken

    def allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int] = ()) -> None:
        """Give `seq` the prefix-cache `hits` (a fresh sequence only), then pages for `num_new_tokens`."""
        hits = list(hits)
        assert self.can_allocate(seq, num_new_tokens, hits)
        held = len(seq.block_table)
        if not seq.block_table:
            seq.num_cached_tokens = len(hits) * self.block_size
        if hits:
            assert not seq.block_table and seq.num_computed_tokens == 0
            for bid in hits:
                self._acquire(bid)
            seq.block_table.extend(hits)
            seq.num_computed_tokens = len(hits) * self.block_size
            last = self.blocks[hits[-1]]
            seq.num_hashed_blocks, seq.chain_hash, seq.chain_serial = len(hits), last.hash, last.serial
            self.num_hits += len(hits)
        for _ in range(self._new_pages_needed(seq, num_new_tokens, [])):
            seq.block_table.append(self._take_page())
        if len(seq.block_table) > held:
            self.tables.extend(seq, seq.block_table[held:])

    def _acquire(self, bid: int) -> None:
        block = self.blocks[bid]
        if block.ref_count == 0:
            del self.evictable[bid]
        block.ref_count += 1

    def _take_page(self) -> int:
        if self.free_ids:
            bid = self.free_ids.popleft()
        else:
            bid, _ = self.evictable.popitem(last=False)  # least recently released
            self._uncache(self.blocks[bid])
        block = self.blocks[bid]
        assert block.ref_count == 0 and block.hash is None
        block.ref_count = 1
        return bid

    def _uncache(self, block: Block) -> None:
        assert self.hash_to_block.get(block.hash) == block.block_id
        del self.hash_to_block[block.hash]
        block.hash = block.token_ids = block.serial = block.parent_serial = None

    def free(self, seq: Sequence) -> None:
        """Release all of `seq`'s pages; its cached content stays findable until evicted."""
        # Release the tail first, so eviction takes a sequence's last pages before its shared prefix.
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            assert block.ref_count > 0, f"page {bid} released more often than taken"
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None:
                    self.evictable[bid] = None
                else:
                    self.free_ids.append(bid)
        seq.block_table = []
        self.tables.release(seq)
        seq.num_computed_tokens = seq.num_hashed_blocks = 0
        seq.chain_hash = seq.chain_serial = None

    # ---------------------------------------------------------------- prefix cache registration
    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the pages of `seq` that are now full of computed tokens."""
        if not self.enable_prefix_caching or seq.chain_serial == BROKEN:
            return
        P = self.block_size
        for i in range(seq.num_hashed_blocks, seq.num_computed_tokens // P):
            tokens = tuple(seq.token_ids[i * P:(i + 1) * P])
            assert PENDING not in tokens, "a page is cached before its tokens are known"
            h = self.hash_fn(seq.chain_hash, tokens)
            existing = self.hash_to_block.get(h)
            if existing is not None:
                other = self.blocks[existing]
                if other.token_ids != tokens or other.parent_serial != seq.chain_serial:
                    seq.chain_serial = BROKEN  # collision with different content: stop caching this sequence
                    return
                serial = other.serial  # same content is already cached (e.g. computed twice in one step)
            else:
                block = self.blocks[seq.block_table[i]]
                assert block.hash is None
                block.hash, block.token_ids, block.parent_serial = h, tokens, seq.chain_serial
                block.serial = serial = next(self._serials)
                self.hash_to_block[h] = block.block_id
            seq.num_hashed_blocks, seq.chain_hash, seq.chain_serial = i + 1, h, serial

    def reset_prefix_cache(self) -> None:
        """Forget every unreferenced cached page."""
        while self.evictable:
            bid, _ = self.evictable.popitem(last=False)
            self._uncache(self.blocks[bid])
            self.free_ids.append(bid)

    # ---------------------------------------------------------------- invariants (tests, debugging)
    def check_invariants(self, seqs: Iterable[Sequence]) -> None:
        P, seqs = self.block_size, list(seqs)
        owners = [0] * self.num_blocks
        logical = {}
        for seq in seqs:
            assert len(set(seq.block_table)) == len(seq.block_table), f"{seq} holds a page twice"
            assert len(seq.block_table) >= self.blocks_for(seq.num_computed_tokens), seq
            if seq.table_row != NO_ROW:  # (the rows a step reads mirror the lists)
                n = self.tables.lens[seq.table_row]
                assert self.tables.pages_RW[seq.table_row, :n].tolist() == seq.block_table, f"{seq}'s row differs"
            for i, bid in enumerate(seq.block_table):
                owners[bid] += 1
                assert logical.setdefault(bid, i) == i, f"page {bid} sits at two logical indices"
                block = self.blocks[bid]
                if block.token_ids is not None:
                    assert block.token_ids == tuple(seq.token_ids[i * P:(i + 1) * P]), \
                        f"cached page {bid} holds other tokens than {seq} at page {i}"
        rows = [seq.table_row for seq in seqs if seq.block_table]
        assert NO_ROW not in rows and len(set(rows)) == len(rows), "a sequence's pages without a row of its own"
        free, evictable = set(self.free_ids), set(self.evictable)
        assert len(free) == len(self.free_ids) and not free & evictable
        for block in self.blocks:
            assert block.ref_count == owners[block.block_id], \
                f"page {block.block_id}: ref_count {block.ref_count} but {owners[block.block_id]} owners"
            unreferenced = block.ref_count == 0
            assert unreferenced == (block.block_id in free or block.block_id in evictable), \
                f"page {block.block_id} leaked or double-listed"
            assert (block.block_id in evictable) <= (block.hash is not None)
            if block.hash is not None:
                assert self.hash_to_block[block.hash] == block.block_id
                assert len(block.token_ids) == P
        assert len(self.hash_to_block) == sum(b.hash is not None for b in self.blocks)
