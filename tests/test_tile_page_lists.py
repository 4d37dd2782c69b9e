"""Prefill tiles that read the pool's 128-token pages in place (metadata.tile_page_lists + the direct paged mask):
every key a row may see is visited exactly once, at its own physical page, also where requests of one tile share
pages of a cached prefix, and where q blocks of several tiles (FA4's 384-row blocks) hold several requests. The
kernel is simulated here from the lists: a full page's keys all count, a partial page's keys count where the mask
says so."""
import random

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from flexengine import masks
from flexengine.attention.backends.paged_mods import paged_mask
from flexengine.attention.layout import DEAD_KV0, KV_TILE, Q_TILE, plan_layout
from flexengine.attention.metadata import build_metadata, tile_page_lists
from test_metadata import CASE_LIST, CASES

P = KV_TILE


def make_shared_step(rng, reqs):
    """Block tables in which a request may start with some pages of an earlier one (a cached prefix)."""
    pages = [-(-L // P) for L, _ in reqs]
    NB = sum(pages) + 2
    free = list(range(NB))
    rng.shuffle(free)
    width = max(pages) + 1
    own = []  # each request's pages
    for n in pages:
        donor = rng.choice(own) if own else []
        shared = donor[: rng.randint(0, min(n - 1, len(donor)))]  # a prefix of another's pages, at the same places
        own.append(shared + [free.pop() for _ in range(n - len(shared))])
    return [row + [rng.randrange(NB) for _ in range(width - len(row))] for row in own], NB  # garbage past the pages


def visited_keys(meta, mask_mod, lists, t, group):
    """{row: [(page, offset) each time the simulated kernel reads that key for the row]} for q block t of `group`
    tiles (the last block may hold fewer)."""
    kv_num, kv_idx, full_num, full_idx = lists
    first, end = t * group * Q_TILE, min((t + 1) * group, meta.layout.num_tiles) * Q_TILE
    rows = torch.arange(first, end)[:, None]
    seen = {r: [] for r in range(first, end)}
    mask = paged_mask(meta, mask_mod, False, direct=True)
    offsets = torch.arange(P)[None, :]
    for page in kv_idx[t, : kv_num[t]].tolist():
        allowed = mask(0, torch.tensor(0), rows, page * P + offsets)
        for r, off in allowed.nonzero().tolist():
            seen[first + r].append((page, off))
    for page in full_idx[t, : full_num[t]].tolist():
        for r in seen:
            seen[r] += [(page, off) for off in range(P)]
    return seen


@settings(max_examples=40, deadline=None)
@given(CASES, st.lists(st.tuples(st.integers(1, 600), st.sampled_from(["decode", "prefill", "chunk", "short"])),
                       min_size=1, max_size=5), st.integers(0, 10_000), st.sampled_from([1, 2, 3]))
@example(CASE_LIST[0], [(600, "prefill")], 0, 3)  # a block of one request with full pages, and a short last block
@example(CASE_LIST[1], [(40, "short"), (600, "prefill"), (300, "prefill")], 0, 3)  # blocks of one and of two requests
def test_each_allowed_key_is_visited_once_at_its_page(case, shapes, seed, group):
    mask_mod, plain = masks.get_mask_mod(case[0]), case[1]
    rng = random.Random(seed)
    reqs = [(L, {"decode": 1, "prefill": L, "chunk": rng.randint(1, L), "short": min(L, rng.randint(2, 9))}[kind])
            for L, kind in shapes]
    tables, NB = make_shared_step(rng, reqs)
    seq_lens = [L for L, _ in reqs]
    layout = plan_layout([n for _, n in reqs], seq_lens, block_size=P, pad_tiles_to=rng.choice([0, 4]))
    meta = build_metadata(torch.tensor(tables, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
                          torch.empty(0, dtype=torch.long), layout, P, NB)
    capacity = len(meta.ws_src)
    lists = tile_page_lists(meta, mask_mod, [], capacity, group)
    assert all(x.shape[0] == -(-layout.num_tiles // group) for x in lists)
    for t in range(lists[0].shape[0]):
        for r, keys in visited_keys(meta, mask_mod, lists, t, group).items():
            if layout.prefill_kv0[r] == DEAD_KV0:  # a decode token's or padding: its output is never read (a full
                continue                            # page counts for it as for every row of the tile)
            b, q = int(layout.prefill_req[r]), int(layout.prefill_pos[r])
            want = [(tables[b][kv // P], kv % P) for kv in range(seq_lens[b]) if plain(b, 0, q, kv)]
            assert sorted(keys) == sorted(want), f"tile {t} row {r} (request {b}, position {q})"


def test_wide_q_blocks_only_for_long_contexts_in_the_largest_bucket():
    """compile.wide_q_tiles: a step takes the backend's wide q blocks only when it fills the largest prefill bucket and
    every prefilling request reads a long context before its chunk (a wide block's diagonal pages are all partial,
    which costs more than it gains over short contexts); decode rows do not count."""
    import numpy as np
    from flexengine.compile import wide_q_tiles
    from flexengine.compile.policy import WIDE_Q_MIN_CONTEXT as C

    def choose(query_lens, seq_lens, tiles=64, wide=3, top=64):
        return wide_q_tiles(wide, np.array(query_lens), np.array(seq_lens), tiles, top)

    assert choose([8192], [C + 8192]) == 3                  # a later chunk of a long prompt
    assert choose([1, 8000], [40, C + 8000]) == 3           # with a decode row beside it
    assert choose([8192], [C - 1 + 8192]) == 1              # context one token short
    assert choose([4096, 4096], [C + 4096, 4096]) == 1      # one prefill over a short context
    assert choose([8192], [C + 8192], tiles=56) == 1        # not the largest bucket
    assert choose([8192], [C + 8192], wide=1) == 1          # the backend has no wide blocks
    assert choose([1, 1], [C, C]) == 1                      # decode only
