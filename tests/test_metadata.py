"""The metadata builder on its own: the page map, the query placement, and the page lists."""
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_reference import PLAIN_MASKS
from flexengine import masks
from flexengine.attention import metadata
from flexengine.attention.metadata import (build_metadata, build_phys_to_logical, decode_full_lists, page_lists,
                                            workspace_lists)
from flexengine.attention.layout import DEAD_KV0, KV_TILE, Q_TILE, plan_layout


def make_step(rng, reqs, P, spare=2):
    seq_lens = [L for L, _ in reqs]
    pages = [(L + P - 1) // P for L in seq_lens]
    NB = sum(pages) + spare
    order = list(range(NB))
    rng.shuffle(order)
    width = max(pages) + 1
    tables, used = [], 0
    for n in pages:
        tables.append(order[used:used + n] + [rng.randrange(NB) for _ in range(width - n)])
        used += n
    layout = plan_layout([n for _, n in reqs], seq_lens, block_size=P, pad_workspace_to=rng.choice([0, 1000]))
    meta = build_metadata(torch.tensor(tables, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
                          torch.empty(0, dtype=torch.long), layout, P, NB)
    return meta, tables


def test_phys_to_logical_ignores_garbage_entries():
    bt = torch.tensor([[3, 1, 7, 7], [0, 2, 5, 6]], dtype=torch.int32)  # columns past the pages are garbage
    p2l = build_phys_to_logical(bt, torch.tensor([20, 9]), 8, num_blocks=8)
    assert p2l[3] == 0 and p2l[1] == 1 and p2l[7] == 2  # request 0: 3 pages
    assert p2l[0] == 0 and p2l[2] == 1                  # request 1: 2 pages
    assert p2l[5] == 0 and p2l[6] == 0                  # garbage never scattered


def test_plan_layout_reads_the_token_buffer_in_place():
    """Prefill rows are the packed tokens themselves, cut into tiles; a tile may hold two requests."""
    query_lens, seq_lens = [1, 300, 1, 129, 2], [10, 300, 5, 200, 2]
    lay = plan_layout(query_lens, seq_lens)
    T = sum(query_lens)
    assert lay.num_decode == 2 and lay.num_tiles == -(-T // Q_TILE) == 4 and lay.token_capacity == 4 * Q_TILE
    assert list(lay.decode_src) == list(lay.decode_dst) == [0, 301]
    # row r is token r: its request and logical position; decode tokens and padding are dead rows
    want = {r: (1, r - 1) for r in range(1, 301)} | {r: (3, 71 + r - 302) for r in range(302, 431)} | \
        {431: (4, 0), 432: (4, 1)}
    for r in range(lay.num_tiles * Q_TILE):
        if r in want:
            assert (lay.prefill_req[r], lay.prefill_pos[r]) == want[r] and lay.prefill_kv0[r] == 0, r
        else:  # the first prefilling request's last position: a real coordinate for the mod
            assert lay.prefill_kv0[r] == DEAD_KV0 and (lay.prefill_req[r], lay.prefill_pos[r]) == (1, 299), r
    # segments: each request's part of each tile
    first = lay.num_decode
    segs = list(zip(lay.seg_tile, lay.span_req[first:], lay.span_q_lo[first:], lay.span_q_hi[first:]))
    assert segs == [(0, 1, 0, 126), (1, 1, 127, 254), (2, 1, 255, 299), (2, 3, 71, 152), (3, 3, 153, 199),
                    (3, 4, 0, 1)]
    assert list(lay.tile_single) == [True, True, False, False]


def test_padding_rows_have_no_token_row():
    lay = plan_layout([1, 5], [4, 5], pad_decode_to=4, pad_tiles_to=3, pad_segments_to=4)
    assert lay.num_decode == 4 and lay.num_tiles == 3 and lay.num_segments == 4
    assert list(lay.decode_dst) == [0, -1, -1, -1]
    assert list(lay.span_valid) == [True, False, False, False, True, False, False, False]
    assert (lay.prefill_kv0[6:] == DEAD_KV0).all() and lay.prefill_kv0[0] == DEAD_KV0


CASE_LIST = [
    ("causal", PLAIN_MASKS["causal"]),
    ("bidirectional", PLAIN_MASKS["bidirectional"]),
    (masks.sliding_window(5), PLAIN_MASKS["sliding_window"](5)),
    (masks.sliding_window(40), PLAIN_MASKS["sliding_window"](40)),
    (masks.chunked_local(24), PLAIN_MASKS["chunked_local"](24)),
    (masks.prefix_lm(37), PLAIN_MASKS["prefix_lm"](37)),
    (masks.and_masks("causal", masks.sliding_window(20)), PLAIN_MASKS["sliding_window"](20)),
    (masks.or_masks(masks.sliding_window(8), masks.prefix_lm(4)),
     lambda b, h, q, kv: 0 <= q - kv < 8 or kv <= q or kv < 4),
    (lambda b, h, q, kv: kv <= q, PLAIN_MASKS["causal"]),  # no kv_bounds: every page partial
]
CASES = st.sampled_from(CASE_LIST)


def check_blocks(where, b, L, plain, qs, own, partial, full, B, full_allowed=True):
    """Request b's queries `qs` against its blocks: `own[j]` is the listed index of logical block j (B
    tokens); every block the mask allows is listed, and a full one is all-true (and full_allowed)."""
    for lb, block in enumerate(own):
        kvs = range(lb * B, min((lb + 1) * B, L))
        allowed = [plain(b, 0, q, kv) for q in qs for kv in kvs]
        if any(allowed):
            assert block in partial or block in full, f"{where}: allowed block {lb} of request {b} is missing"
        if block in full:
            assert all(allowed) and len(kvs) == B and full_allowed, f"{where}: block {lb} marked full but is not"


def check_lists(t, b, L, plain, qs, own, partial, full, B):
    """Decode row t's lists cover exactly the mask over its request's own blocks `own`."""
    assert set(partial) <= set(own) and set(full) <= set(own), "a block of another request appears"
    assert not set(partial) & set(full) and len(set(partial)) == len(partial) and len(set(full)) == len(full)
    check_blocks(f"row {t}", b, L, plain, qs, own, partial, full, B)


def check_tile_lists(t, lay, reqs, plain, partial, full):
    """Prefill tile t reads only the workspace blocks of its own requests, every block a live row of it
    may see, and as full only blocks all-true for every live row (so only in a tile of one request)."""
    rows = [r for r in range(t * Q_TILE, (t + 1) * Q_TILE) if lay.prefill_kv0[r] != DEAD_KV0]
    by_req = {}
    for r in rows:
        by_req.setdefault(int(lay.prefill_req[r]), (int(lay.prefill_kv0[r]), []))[1].append(int(lay.prefill_pos[r]))
    assert not set(partial) & set(full) and len(set(partial)) == len(partial) and len(set(full)) == len(full)
    owned = set()
    for b, (kv0, qs) in by_req.items():
        L = reqs[b][0]
        own = range(kv0 // KV_TILE, kv0 // KV_TILE + -(-L // KV_TILE))
        owned.update(own)
        check_blocks(f"tile {t}", b, L, plain, qs, own, partial, full, KV_TILE, full_allowed=len(by_req) == 1)
    assert set(partial) | set(full) <= owned, f"tile {t} lists a block of no request in it"


def check_page_lists(rng, P, case, reqs):
    """Decode rows list the request's own pages; prefill tiles list their requests' own KV tiles of the
    workspace, into which the pages are gathered in logical order."""
    mask, plain = case
    meta, tables = make_step(rng, reqs, P)
    mask = masks.get_mask_mod(mask)
    lay = meta.layout
    kv_num, kv_idx, full_num, full_idx = page_lists(meta, mask, [])
    for t in range(lay.num_decode):
        b = int(lay.span_req[t])
        L = reqs[b][0]
        check_lists(t, b, L, plain, [L - 1], tables[b][: (L + P - 1) // P], [int(x) for x in kv_idx[t, : kv_num[t]]],
                    [int(x) for x in full_idx[t, : full_num[t]]], P)
    ws_src = meta.ws_src.tolist()
    cap = -(-len(ws_src) * P // KV_TILE)
    kv_num, kv_idx, full_num, full_idx = workspace_lists(meta, mask, [], cap)
    for t in range(lay.num_tiles):
        check_tile_lists(t, lay, reqs, plain, [int(x) for x in kv_idx[t, : kv_num[t]]],
                         [int(x) for x in full_idx[t, : full_num[t]]])
    live_pages = set()
    starts = np.cumsum([0] + [n for _, n in reqs])
    for b, (L, n) in enumerate(reqs):
        if n == 1:
            continue
        kv0 = int(lay.prefill_kv0[starts[b]])
        assert kv0 % KV_TILE == 0
        for pos in range(L):  # the workspace holds the request's context from kv0, in order
            assert ws_src[(kv0 + pos) // P] == tables[b][pos // P]
        live_pages.update((kv0 + pos) // P for pos in range(L))
    # every other page (alignment tails, padding) is skipped by the copy
    assert all(ws_src[i] == -1 for i in range(len(ws_src)) if i not in live_pages)


@settings(max_examples=80, deadline=None)
@given(st.sampled_from([8, 16, 32]), CASES,
       st.lists(st.tuples(st.integers(1, 300), st.sampled_from(["decode", "prefill", "chunk"])), min_size=1, max_size=5),
       st.integers(0, 1000))
def test_page_lists_cover_exactly_the_mask(P, case, shapes, seed):
    rng = random.Random(seed)
    reqs = [(L, {"decode": 1, "prefill": L, "chunk": rng.randint(1, L)}[kind]) for L, kind in shapes]
    check_page_lists(rng, P, case, reqs)


def test_page_lists_at_every_offset_within_a_page():
    """Chunks starting at each position of a page: the boundary cases a random draw can miss."""
    P = 8
    reqs = [(ctx + n, n) for ctx in range(2 * P) for n in (1, 2, 9)]
    for case in CASE_LIST:
        check_page_lists(random.Random(0), P, case, reqs)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([8, 16]), CASES, st.lists(st.integers(1, 300), min_size=1, max_size=4), st.integers(2, 32),
       st.integers(0, 1000))
def test_kernel_split_lists_every_page_once_as_partial(P, case, lens, splits, seed):
    """Split-KV inside the kernel (FLEXENGINE_SPLIT_KV=kernel; auto's choice for a lone request): one decode row per
    request, no full list (flex's template splits a full list by the pool's length), and the partial list holds exactly the pages the
    split-rows layout lists as partial or full for that request."""
    mask = masks.get_mask_mod(case[0])
    lists = {}
    for mode in ("kernel", "rows"):
        meta, _ = make_step(random.Random(seed), [(L, 1) for L in lens], P)
        with pytest.MonkeyPatch.context() as env:
            env.setenv("FLEXENGINE_SPLIT_KV", mode)
            lay = plan_layout([1] * len(lens), lens, decode_splits=splits, block_size=P)
        meta = build_metadata(meta.block_tables, meta.seq_lens, torch.empty(0, dtype=torch.long), lay, P, meta.num_blocks)
        rows = 1 if mode == "kernel" else splits
        assert (lay.decode_splits, lay.kernel_splits) == ((1, splits) if mode == "kernel" else (splits, 1))
        kv_num, kv_idx, full_num, full_idx = page_lists(meta, mask, [])
        assert kv_num.shape[0] == len(lens) * rows
        lists[mode] = [sorted([int(x) for r in range(b * rows, (b + 1) * rows) for x in kv_idx[r, : kv_num[r]]]
                              + [int(x) for r in range(b * rows, (b + 1) * rows) for x in full_idx[r, : full_num[r]]])
                       for b in range(len(lens))]
        if mode == "kernel":
            assert int(full_num.sum()) == 0
    assert lists["kernel"] == lists["rows"]


def test_split_kv_auto_splits_a_lone_request_in_the_kernel_and_refuses_nonsense(monkeypatch):
    """auto (the default): a step's lone decode request (padding counted) is split by the kernel's programs, more
    requests by rows (full pages skip the mask there: 8 x 8192 ran at 0.90x SDPA-flash against 0.79x)."""
    from flexengine.config import env_split_kv
    monkeypatch.delenv("FLEXENGINE_SPLIT_KV", raising=False)
    assert env_split_kv() == "auto"
    one = plan_layout([1], [300], decode_splits=8, block_size=16)
    two = plan_layout([1, 1], [300, 20], decode_splits=8, block_size=16)
    padded = plan_layout([1], [300], pad_decode_to=2, decode_splits=8, block_size=16)
    with_prompt = plan_layout([1, 40], [300, 40], decode_splits=8, block_size=16)
    assert (one.decode_splits, one.kernel_splits) == (1, 8) and (with_prompt.decode_splits, with_prompt.kernel_splits) == (1, 8)
    assert (two.decode_splits, two.kernel_splits) == (8, 1) and (padded.decode_splits, padded.kernel_splits) == (8, 1)
    monkeypatch.setenv("FLEXENGINE_SPLIT_KV", "Rows")
    assert env_split_kv() == "rows"
    monkeypatch.setenv("FLEXENGINE_SPLIT_KV", "both")
    with pytest.raises(ValueError, match="FLEXENGINE_SPLIT_KV must be one of auto, kernel, rows"):
        env_split_kv()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_to_device_through_the_pinned_ring_keeps_every_copy():
    """More copies than the ring has slots, queued behind slow GPU work: a slot rewritten before its copy
    ran would hand the device another array's values."""
    from flexengine.attention.staging import PinnedStaging, copy_into, to_device
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(10):
        x @ x  # keep the stream busy while the copies queue up
    # every third array transposed (not contiguous), every fifth into a buffer (copy_into), some empty
    arrays = [np.full((3, 5 + i % 7), i, dtype=np.int64 if i % 2 else np.float32) for i in range(3 * PinnedStaging.SLOTS)]
    arrays = [a.T if i % 3 == 0 else a[:, :0] if i % 11 == 0 else a for i, a in enumerate(arrays)]
    buffers = {i: torch.zeros(64, dtype=torch.int64 if i % 2 else torch.float32, device="cuda")
               for i in range(0, len(arrays), 5)}
    copies = []
    for i, a in enumerate(arrays):
        if i in buffers:
            copy_into(a, buffers[i], "cuda")
            copies.append(buffers[i][: a.size].view(a.shape))
        else:
            copies.append(to_device(a, "cuda"))
    for a, c in zip(arrays, copies):
        np.testing.assert_array_equal(c.cpu().numpy(), a)


def test_decode_splits_env_caps_the_splits_and_refuses_nonsense(monkeypatch):
    """FLEXENGINE_DECODE_SPLITS caps split-KV on CUDA (every rank reads the same environment); off CUDA splits
    are always 1, and a value that is not a positive integer is a ValueError that names the variable."""
    from flexengine.attention.layout import choose_decode_splits
    from flexengine.config import env_decode_splits
    monkeypatch.delenv("FLEXENGINE_DECODE_SPLITS", raising=False)
    assert env_decode_splits() is None
    for value in ("1", "7"):
        monkeypatch.setenv("FLEXENGINE_DECODE_SPLITS", value)
        assert env_decode_splits() == int(value)
        assert choose_decode_splits(1, 8, "cpu") == 1
        if torch.cuda.is_available():
            assert choose_decode_splits(1, 1, "cuda") == int(value)  # one row, one head: the cap decides
    for value in ("0", "-2", "four"):
        monkeypatch.setenv("FLEXENGINE_DECODE_SPLITS", value)
        with pytest.raises(ValueError, match="FLEXENGINE_DECODE_SPLITS must be a positive integer"):
            env_decode_splits()


def test_compiled_decode_lists_equal_eager_across_buckets(monkeypatch, tmp_path):
    """The decode page lists through Inductor (as the CUDA engine's decode graphs build them, here on the CPU)
    equal the eager ones for every built-in mask, over buckets of 1-32 rows with 1-32 splits each, and one
    dynamic graph serves them (a recompile per bucket would cost start-up and could reach dynamo's limit). Each
    bucket writes its lists into the leading rows and columns of the same pool-wide tables, as the decode graphs'
    kept tables are written: what a BlockMask reads is page_lists' lists then zeros, whatever bucket ran before.
    Steps of up to 16 rows list every page as partial here, as a GPU's do (DECODE_PARTIAL_ROWS), so both sides of
    that choice run in the one graph. The buckets' layouts are the decode graphs' (cuda_graphs.decode_layout), and a
    step with prompt tokens and one decode row shares the batch-1 bucket's graph of the lists (a graph of its own
    on an H200's fresh start before decode_layout padded the one-row bucket, session 48), as every other bucket does
    (decode_lists lists a row more than the step's decode rows, which the caller drops)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # a cached graph brings its old guards
    monkeypatch.setattr(metadata, "PARTIAL_ONLY_ON_CPU", True)
    monkeypatch.setattr(metadata, "DECODE_PARTIAL_ROWS", 16)
    from flexengine.attention.backends.paged_mods import decode_lists
    from flexengine.compile import compile_count, compiled_on_first_use
    from flexengine.compile.cuda_graphs import decode_layout, own_layout_tensors, refresh_decode_positions
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    torch._dynamo.reset()
    # as the engine compiles them: a recompile limit that raises, no duck sizing
    lists, positions = compiled_on_first_use(decode_lists)(), compiled_on_first_use(refresh_decode_positions)()
    rng, P, NB = random.Random(0), 16, 64
    def per_request_prefix(b, h, q_idx, kv_idx, prefix_len):  # a mod reading a per-request parameter
        return (kv_idx <= q_idx) | (kv_idx < prefix_len[b])

    # causal, a window, a mask with no bounds, one with a parameter (C++ compiles take seconds each on the CPU)
    for case in (CASE_LIST[0], CASE_LIST[2], CASE_LIST[-1], (per_request_prefix, None)):
        mask = masks.get_mask_mod(case[0])
        before = compile_count()
        graphs = [len(_debug_get_cache_entry_list(fn.__code__)) for fn in (decode_lists, refresh_decode_positions)]
        kept = [[torch.zeros(33, NB, dtype=torch.int32) for _ in range(2)] for _ in range(2)]  # eager's, compiled's
        # (32 rows and one: decode_lists lists a row more, as kept_page_lists makes room for)
        # as the decode graphs run them: lengths and tables of every row of the buffers (32), the bucket's leading
        # rows read, the largest bucket first; then a step with prompt tokens and one decode row (its lists only)
        for bs, splits in [(32, 1), (16, 2), (8, 4), (4, 8), (2, 16), (1, 32), (3, 5), (24, 1), (1, 1), (1, "mixed")]:
            seq_lens = [rng.randint(1, 200) for _ in range(32)]
            tables = torch.tensor([rng.sample(range(NB), 13) for _ in range(32)], dtype=torch.int32)
            if splits == "mixed":  # one decode row beside two prompt chunks
                seq_lens[1:3] = 150, 90
                layout = plan_layout([1, 40, 90], seq_lens[:3], block_size=P)
            else:
                layout = decode_layout(seq_lens[:bs], splits)
            metas = [own_layout_tensors(build_metadata(tables, torch.tensor(seq_lens, dtype=torch.int32),
                                                       torch.empty(0, dtype=torch.long), layout, P, NB))
                     for _ in range(2)]  # (own tensors, as the decode graphs' and the prompt-step graphs' plans give)
            if splits != "mixed":  # (a step with prompt tokens plans its positions on the host or in its plan)
                for m in metas:  # stale positions: the refresh must rewrite them
                    m.span_q_lo.fill_(-5), m.span_q_hi.fill_(-5), m.phys_to_logical.fill_(7)
                refresh_decode_positions(metas[0])
                positions(metas[1])
                for name in ("phys_to_logical", "span_q_lo", "span_q_hi"):
                    assert torch.equal(getattr(metas[0], name), getattr(metas[1], name)), (case[0], bs, name)
            values = [torch.tensor([rng.randint(0, 60) for _ in range(32)])] if case[1] is None else []
            want, got = decode_lists(metas[0], mask, values, *kept[0]), lists(metas[1], mask, values, *kept[1])
            for a, b in zip(want, got):
                assert torch.equal(a, b), (case[0], bs, splits)
            kv_num, kv_idx, full_num, full_idx = page_lists(metas[0], mask, values)
            rows = len(kv_idx)  # (bs * splits at most: plan_layout may give a row fewer splits)
            assert rows <= bs * (splits if splits != "mixed" else 1)
            read = [0, 1] if decode_full_lists(metas[0]) else [0]  # (no full list: kernel splits)
            for lists_RM, eager, compiled in [((kv_idx, full_idx)[i], kept[0][i], kept[1][i]) for i in read]:
                assert torch.equal(eager[:rows, :13], lists_RM) and not eager[:rows, 13:].any(), (case[0], bs)
                assert torch.equal(compiled[:rows], eager[:rows]), (case[0], bs, splits)
        # the lists: one graph, one row's included (decode_lists lists a row more: dynamo would specialise a
        # size of 1, a graph of its own until session 50), split rows or not (a graph each before
        # metadata.keeps_full_lists); the positions: one graph, with the first mask. Sizes equal at the first trace
        # (32 rows of 32) taken as one symbol made 8 of the first mask's (compile/policy.py: without_duck_sizing)
        added = [len(_debug_get_cache_entry_list(fn.__code__)) - n
                 for fn, n in zip((decode_lists, refresh_decode_positions), graphs)]
        assert added == [1, 1 if case is CASE_LIST[0] else 0], (case[0], added)
        assert compile_count() - before == sum(added)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([8, 16]), CASES, st.lists(st.integers(1, 300), min_size=1, max_size=4), st.integers(0, 1000))
def test_decode_steps_of_few_rows_list_every_page_as_partial(P, case, lens, seed):
    """Up to metadata.DECODE_PARTIAL_ROWS decode rows: one program a decode row still, no full list, and the partial
    list holds exactly the pages the lists of a larger step hold as partial or full (the mask then decides every
    page's keys)."""
    mask = masks.get_mask_mod(case[0])
    lists = {}
    for partial_rows in (0, len(lens)):
        meta, _ = make_step(random.Random(seed), [(L, 1) for L in lens], P)
        assert meta.layout.kernel_splits == 1
        with pytest.MonkeyPatch.context() as env:
            env.setattr(metadata, "DECODE_PARTIAL_ROWS", partial_rows)
            assert decode_full_lists(meta)  # on the CPU, always (Inductor's C++ flex kernel needs them)
            env.setattr(metadata, "PARTIAL_ONLY_ON_CPU", True)
            assert decode_full_lists(meta) == (partial_rows == 0)
            kv_num, kv_idx, full_num, full_idx = page_lists(meta, mask, [])
        lists[partial_rows] = [sorted([int(x) for x in kv_idx[b, : kv_num[b]]]
                                      + [int(x) for x in full_idx[b, : full_num[b]]]) for b in range(len(lens))]
        if partial_rows:
            assert int(full_num.sum()) == 0
    assert lists[len(lens)] == lists[0]
