"""The device plan of a step with prompt tokens (attention/device_plan.py) against plan_layout on the host, and its
positions and slots against the requests' tokens written out one by one."""
import numpy as np
import torch
from hypothesis import given, settings, strategies as st

from flexengine.attention.device_plan import PlanCapacity, align_pages, key_views, plan_on_device
from flexengine.attention.layout import Q_TILE, plan_layout, segment_capacity, workspace_tokens
from flexengine.attention.metadata import LAYOUT_FIELDS


@st.composite
def steps(draw):
    """Requests of a step with at least one prompt chunk (query_len, cached tokens), in any order; the padding a
    graph key adds (decode requests, split rows, tiles, workspace pages); the rows the runner's buffers hold."""
    P = draw(st.sampled_from([4, 16, 128]))
    reqs = draw(st.lists(st.tuples(st.sampled_from([1, 1, 2, 3, 7, 40, 130, 300]), st.integers(0, 400)),
                         min_size=1, max_size=9))
    if all(n == 1 for n, _ in reqs):
        reqs[0] = (draw(st.integers(2, 200)), reqs[0][1])
    rows = len(reqs) + draw(st.integers(0, 3))
    num_dec = sum(n == 1 for n, _ in reqs)
    pad_decode = num_dec + draw(st.integers(0, 3)) if num_dec else 0
    split_rows = draw(st.sampled_from([1, 2, 4]))
    T = sum(n for n, _ in reqs)
    tiles = -(-T // Q_TILE) + draw(st.integers(0, 2))
    return P, reqs, rows, pad_decode, split_rows, tiles, draw(st.integers(0, 40))


def expected_positions_and_slots(reqs, tables, P, capacity, scratch):
    positions, slots = np.zeros(capacity, np.int64), np.full(capacity, scratch, np.int64)
    t = 0
    for i, (n, cached) in enumerate(reqs):
        for pos in range(cached, cached + n):
            positions[t], slots[t] = pos, tables[i, pos // P] * P + pos % P
            t += 1
    return positions, slots


@settings(max_examples=60, deadline=None)
@given(steps())
def test_the_device_plan_is_plan_layouts(step):
    P, reqs, rows, pad_decode, split_rows, tiles, extra_pages = step
    ql = [n for n, _ in reqs]
    sl = [n + cached for n, cached in reqs]
    pages = workspace_tokens(ql, sl, P) // P + extra_pages
    segments = segment_capacity(tiles, rows)
    lay = plan_layout(ql, sl, pad_decode_to=pad_decode, pad_tiles_to=tiles, decode_splits=split_rows, block_size=P,
                      pad_workspace_to=pages, pad_segments_to=segments)
    assert lay.num_segments == segments and len(lay.ws_req) == pages
    split_rows = lay.decode_splits  # (a lone decode request's splits are the kernel's programs under auto)
    rng = np.random.default_rng(len(reqs))
    width = max(-(-L // P) for L in sl) + 1
    tables = rng.integers(0, 1000, (rows, width)).astype(np.int32)
    cap = PlanCapacity(decode_requests=pad_decode + 2, decode_rows=(pad_decode + 2) * 4, tiles=tiles + 3,
                       segments=segments + 5, workspace_pages=pages + 7)
    pad = [0] * (rows - len(reqs))
    scratch = 99_999
    plan = plan_on_device(torch.tensor(ql + pad), torch.tensor(sl + pad), torch.from_numpy(tables),
                          torch.tensor([pad_decode, split_rows]), cap, P, align_pages(P), scratch)
    views = key_views(plan, pad_decode, split_rows, tiles, segments, pages)
    for name in LAYOUT_FIELDS:
        want = np.asarray(getattr(lay, name), dtype=np.int64)
        got = views[name].long().numpy()
        assert np.array_equal(got, want), (name, got, want)
    positions, slots = expected_positions_and_slots(reqs, tables, P, tiles * Q_TILE, scratch)
    assert np.array_equal(views["positions"].numpy(), positions)
    assert np.array_equal(views["slots"].numpy(), slots)


def test_every_array_is_at_the_capacity_whatever_the_step():
    """One compiled function serves every graph key: no output's shape depends on the step."""
    cap = PlanCapacity(decode_requests=4, decode_rows=8, tiles=3, segments=9, workspace_pages=12)
    shapes = set()
    for ql, sl in (([5, 1, 0], [9, 3, 0]), ([130, 0, 0], [130, 0, 0]), ([2, 1, 1], [2, 40, 7])):
        plan = plan_on_device(torch.tensor(ql), torch.tensor(sl), torch.zeros(3, 9, dtype=torch.int32),
                              torch.tensor([2, 2]), cap, 16, align_pages(16), 0)
        shapes.add(tuple((name, tuple(t.shape)) for name, t in sorted(plan.items())))
    assert len(shapes) == 1


def test_the_compiled_plan_equals_the_eager_one_and_compiles_once(monkeypatch, tmp_path):
    """The plan as the CUDA engine runs it (compile.compiled_on_first_use: dynamic shapes, one graph, here Inductor
    on the CPU): what the eager plan gives, for steps of several graph keys, and no second compile (dynamo must trace
    all of it: a math.lcm of the page size once broke the GPU engine's start-up)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    from flexengine.compile import compile_count, compiled_on_first_use
    torch._dynamo.reset()
    compiled = compiled_on_first_use(plan_on_device)()
    cap = PlanCapacity(decode_requests=4, decode_rows=16, tiles=3, segments=9, workspace_pages=12)
    P, tables = 16, torch.arange(4 * 20, dtype=torch.int32).view(4, 20)
    before = None
    steps = [(([5, 1, 0, 0], [9, 3, 0, 0]), [1, 1]), (([130, 2, 1, 1], [130, 20, 7, 40]), [2, 4]),
             (([300, 0, 0, 0], [300, 0, 0, 0]), [0, 1])]
    for (ql, sl), shape in steps:
        args = (torch.tensor(ql), torch.tensor(sl), tables, torch.tensor(shape), cap, P, align_pages(P), 7)
        got, want = compiled(*args), plan_on_device(*args)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        before = compile_count() if before is None else before
    assert compile_count() == before, "a second graph key compiled the plan again"
