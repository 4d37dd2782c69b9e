"""The decode step's host inputs: a batch that only moved on one token is sent as its changes, and those
changes, applied to the last step's buffers the way the device applies them, give the whole pack."""
from __future__ import annotations

import types

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from flexengine.engine.decode_inputs import DecodeTracker, pack_decode

P = 4


class FakeSeq(types.SimpleNamespace):
    __eq__, __hash__ = object.__eq__, object.__hash__  # by identity, as a Sequence


def seq(num_tokens: int, pages: list[int]):
    return FakeSeq(token_ids=list(range(100, 100 + num_tokens)), block_table=pages, num_tokens=num_tokens)


def step_on(s, new_page: int | None) -> None:
    s.token_ids.append(len(s.token_ids) * 7 % 50)
    s.num_tokens += 1
    if new_page is not None:
        s.block_table.append(new_page)


def apply_on_device(packed: np.ndarray, moved, width: int) -> np.ndarray:
    """What run_moved_on makes the decode graph do to its buffers (cuda_graphs.move_on), in numpy."""
    out = np.zeros((4 + width, packed.shape[1]), dtype=np.int64)
    out[: packed.shape[0]] = packed
    if moved.src is not None:  # the last batch's columns the rows come from (some left, the rest in any order)
        out = out[:, moved.src]
    out[0] = moved.ids
    out[1] += 1
    out[3] += 1
    row, col, page = moved.new_pages
    out[4 + col, row] = page
    R = np.arange(out.shape[1])
    out[2] = out[4 + out[1] // P, R] * P + out[1] % P
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 20), min_size=1, max_size=6), st.integers(1, 12), st.data())
def test_moved_on_reproduces_the_whole_pack(lengths, steps, data):
    next_page = iter(range(1000))
    seqs = [seq(n, [next(next_page) for _ in range(-(-n // P) + data.draw(st.integers(0, 1)))]) for n in lengths]
    tracker = DecodeTracker()
    assert tracker.next_step(seqs) is None  # nothing held yet: the whole pack
    buffers = pack_decode(seqs, P)
    for _ in range(steps):
        for s in seqs:  # a page when the next position needs one, sometimes one early (as a look-ahead would)
            need = -(-(s.num_tokens + 1) // P) > len(s.block_table)
            step_on(s, next(next_page) if need or data.draw(st.integers(0, 9)) == 0 else None)
        if len(seqs) > 1 and data.draw(st.integers(0, 3)) == 0:  # some requests left, the rest in any order
            seqs = data.draw(st.permutations(seqs))[: data.draw(st.integers(1, len(seqs)))]
        moved = tracker.next_step(seqs)
        assert moved is not None
        whole = pack_decode(seqs, P)
        buffers = apply_on_device(buffers, moved, max(whole.shape[0], buffers.shape[0]) - 4)
        np.testing.assert_array_equal(buffers[: whole.shape[0]], whole)
        assert not buffers[whole.shape[0]:].any()


def test_a_changed_batch_is_packed_whole():
    a, b = seq(5, [1, 2]), seq(3, [3])
    tracker = DecodeTracker()
    assert tracker.next_step([a, b]) is None
    step_on(a, None), step_on(b, None)
    assert tracker.next_step([b, a]).src.tolist() == [1, 0]  # another order: each row from its place (held: b, a)
    step_on(a, None), step_on(b, None)
    assert tracker.next_step([a]).src.tolist() == [1]  # a request left
    step_on(a, None)
    c = seq(4, [5])
    assert tracker.next_step([a, c]) is None  # a request joined: packed whole
    step_on(a, None), step_on(c, None)
    assert tracker.next_step([a]).src.tolist() == [0]
    step_on(a, None)
    assert tracker.next_step([a]).src is None  # the same batch
    step_on(a, None), step_on(a, None)
    assert tracker.next_step([a]) is None  # two tokens on: the buffers are one behind
    step_on(a, None)
    a.block_table = [1, 2]  # freed and allocated again (preemption): a new table, whatever it holds
    assert tracker.next_step([a]) is None
    step_on(a, None)
    assert tracker.next_step([a]) is not None
    tracker.forget()
    step_on(a, None)
    assert tracker.next_step([a]) is None


def test_a_steady_move_with_no_new_page_sends_nothing(monkeypatch):
    """The decode graphs' staged header stays in its buffer: a step that moves the same rows on with no new page
    copies nothing, and every other step (new pages, another row count, after a whole batch) sends its own."""
    import torch

    from flexengine.compile import cuda_graphs
    from flexengine.compile.cuda_graphs import FILL, MOVE, DecodeBuffers
    bufs = DecodeBuffers(4, 3, {}, scratch_slot=0, device="cpu")
    sent, copy_into = [], cuda_graphs.copy_into
    monkeypatch.setattr(cuda_graphs, "copy_into", lambda a, *rest: sent.append(a[:3].tolist()) or copy_into(a, *rest))
    ids = torch.tensor([5, 6, 7])
    bufs.move_on_next(ids, np.array([[1], [2], [9]]))  # row 1 gets page 9 in column 2
    assert bufs.inputs[:6].tolist() == [MOVE, 3, 1, 1, 2, 9]
    for n in (3, 3, 2, 2):
        bufs.move_on_next(ids[:n], np.zeros((3, 0), dtype=np.int64))
        assert bufs.inputs[:3].tolist() == [MOVE, n, 0]
        assert bufs.fed_ids[:n].tolist() == ids[:n].tolist()
    bufs.stage(np.zeros((4 + 3, 4), dtype=np.int64), 2, {})
    bufs.move_on_next(ids[:2])
    assert sent == [[MOVE, 3, 1], [MOVE, 3, 0], [MOVE, 2, 0], [FILL, 2, 0], [MOVE, 2, 0]]
