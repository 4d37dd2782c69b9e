"""A step with prompt tokens on the host (engine/step_inputs.pack_lengths) against the plain reading of its
requests: each one's scheduled token ids, lengths and block table, whichever way the ids are stored."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from flexengine.engine.block_tables import BlockTables
from flexengine.engine.decode_inputs import pack_decode
from flexengine.engine.scheduler import ScheduledBatch
from flexengine.engine.sequence import PENDING, Sequence
from flexengine.engine.step_inputs import pack_lengths

P = 4


@st.composite
def requests(draw):
    """(sequence, new tokens) pairs: prompts in chunks, decodes (some with a PENDING input), and sequences whose
    chunk runs past their prompt (recomputed after a preemption), with and without the prompt's array."""
    out = []
    for i in range(draw(st.integers(1, 8))):
        prompt = draw(st.lists(st.integers(0, 999), min_size=1, max_size=30))
        outputs = draw(st.lists(st.integers(0, 999), max_size=5))
        seq = Sequence(request_id=str(i), index=0, token_ids=prompt + outputs, num_prompt_tokens=len(prompt),
                       params=None)
        if outputs and draw(st.booleans()):
            seq.token_ids[-1], seq.num_pending = PENDING, 1
        if draw(st.booleans()):
            seq.prompt_array = np.array(prompt, dtype=np.int64)
        seq.num_computed_tokens = draw(st.integers(0, seq.num_tokens - 1))
        new = draw(st.integers(1, seq.num_tokens - seq.num_computed_tokens))
        seq.block_table = [draw(st.integers(0, 99)) for _ in range(-(-(seq.num_computed_tokens + new) // P))]
        out.append((seq, new))
    return out


def in_rows(seqs, data) -> BlockTables:
    """The sequences' tables written page by page into small BlockTables (so it grows), with rows freed and taken
    again by other sequences on the way (a row keeps no page of its last holder)."""
    tables = BlockTables(rows=1, width=1)
    others = [Sequence(request_id="x", index=0, token_ids=[0], num_prompt_tokens=1, params=None) for _ in range(3)]
    for s in others:
        tables.extend(s, [97, 98, 99])
        if data.draw(st.booleans()):
            tables.release(s)
    for s in seqs:
        for page in s.block_table:
            tables.extend(s, [page])
    return tables


@settings(max_examples=150, deadline=None)
@given(requests(), st.integers(0, 12), st.booleans(), st.data())
def test_pack_lengths_reads_each_requests_tokens_lengths_and_pages(reqs, min_rows, use_rows, data):
    seqs, new = [s for s, _ in reqs], [n for _, n in reqs]
    tables = in_rows(seqs, data) if use_rows else None
    p = pack_lengths(ScheduledBatch(seqs, new, block_tables=tables), min_rows)
    ids = [t for s, n in reqs for t in s.token_ids[s.num_computed_tokens:s.num_computed_tokens + n]]
    assert p.ids.dtype == np.int64 and p.ids.tolist() == ids
    assert p.query_lens.tolist() == new
    rows = max(len(seqs), min_rows)
    lens = [s.num_computed_tokens + n for s, n in reqs]
    assert p.seq_lens.tolist() == lens + [0] * (rows - len(seqs))
    assert p.tables.shape[0] == rows
    assert p.tables.shape[1] == max(len(s.block_table) for s in seqs)
    for r, s in enumerate(seqs):
        assert p.tables[r, :len(s.block_table)].tolist() == s.block_table
        assert not p.tables[r, len(s.block_table):].any()
    ends = np.cumsum(new)
    assert p.last_rows.tolist() == (ends - 1).tolist()
    done = [i for i, (s, n) in enumerate(reqs) if s.num_computed_tokens + n == s.num_tokens]
    assert p.sample_seqs == [seqs[i] for i in done] and p.sample_rows.tolist() == [ends[i] - 1 for i in done]


@settings(max_examples=60, deadline=None)
@given(requests(), st.integers(0, 12), st.data())
def test_pack_decode_from_the_rows_equals_the_lists(reqs, columns, data):
    seqs = [s for s, _ in reqs]
    for s in seqs:  # a decode row's table holds its last token's page
        s.block_table += list(range(200, 200 + -(-s.num_tokens // P) - len(s.block_table)))
    tables = in_rows(seqs, data)
    np.testing.assert_array_equal(pack_decode(seqs, P, columns, block_tables=tables), pack_decode(seqs, P, columns))


def test_host_pack_probe_runs():
    """scripts/host_pack_probe.py (the dev-CPU A/B of these host functions): its five rows, on a small batch (the
    per-row-array packing checked equal to pack_lengths there)."""
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "scripts/host_pack_probe.py", "--requests", "12", "--chunks", "2",
                          "--chunk-len", "40", "--repeat", "1"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert len([line for line in run.stdout.splitlines() if line.startswith("| ") and "µs |" not in line]) == 5
