"""The host functions of a step at 256 requests, on synthetic batches, with no GPU and no model (issue 15, item 3):
what `pack_lengths`, the feed of pending samples and the decode tracker cost on this machine's CPU.

    python3 scripts/host_pack_probe.py [--requests 256 --chunks 6 --chunk-len 256 --repeat 7]

The GPU boxes' CPUs drift within a call (docs/benchmarks.md, sessions 34-35), so a change to these functions is best
compared here first, in one process: `--base DIR` (a checkout of the base, e.g. `git worktree add /tmp/base REV`)
times that tree's `pack_lengths` beside this one's, round by round (their step_inputs.py alone: its imports resolve
to this tree's modules); running the script on both trees one after the other moved 1.6x between runs on the dev
CPU. Rows (best of `--repeat` rounds of 300 calls, the rows interleaved round by round, µs):
- pack_lengths of a mixed step: `--chunks` prompt chunks of `--chunk-len` tokens, the other requests decoding;
- feed of that step (every decode row waits on the step in flight), given the rows as pack_lengths found them;
- DecodeTracker.next_step of a decode batch one token on: the same batch, and the batch less one request (gathered);
- the same step packed from per-row arrays (`pack_from_rows`: each BlockTables row's computed and known token counts
  and last token, as vLLM's persistent batch keeps them), given the batch's rows: what pack_lengths could cost if the
  engine kept those arrays up to date as tokens arrive (it does not; checked equal to pack_lengths here).
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import timeit
import types

import numpy as np
import torch

from flexengine.engine.block_tables import BlockTables
from flexengine.engine.decode_inputs import DecodeTracker
from flexengine.engine.in_flight import InFlightStep
from flexengine.engine.scheduler import ScheduledBatch
from flexengine.engine.sequence import Sequence
from flexengine.engine.step_inputs import chunk_ids, pack_lengths

PAGE = 128


def make_batch(requests: int, chunks: int, chunk_len: int, seed: int = 0):
    """(decoding sequences, prompt-chunk sequences, BlockTables holding all of their pages)."""
    rng = np.random.default_rng(seed)
    tables, page = BlockTables(rows=requests + 8, width=8), 0
    decoding, prefilling = [], []
    for i in range(requests):
        chunk = i >= requests - chunks
        prompt = rng.integers(0, 30000, chunk_len if chunk else int(rng.integers(100, 300))).tolist()
        out = [] if chunk else rng.integers(0, 30000, int(rng.integers(1, 30))).tolist()
        s = Sequence(request_id=str(i), index=0, token_ids=prompt + out, num_prompt_tokens=len(prompt), params=None)
        s.prompt_array = np.array(prompt, dtype=np.int64)
        s.num_computed_tokens = 0 if chunk else s.num_tokens - 1
        new = chunk_len if chunk else 1
        s.block_table = list(range(page, page + -(-(s.num_computed_tokens + new) // PAGE)))
        page += len(s.block_table)
        tables.extend(s, s.block_table)
        (prefilling if chunk else decoding).append(s)
    return decoding, prefilling, tables


def base_pack_lengths(tree: str):
    """pack_lengths of `tree`'s engine/step_inputs.py, loaded beside this tree's."""
    name = "flexengine.engine.base_step_inputs"
    spec = importlib.util.spec_from_file_location(name, f"{tree}/flexengine/engine/step_inputs.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.pack_lengths


def per_row_arrays(seqs, rows: int) -> dict[str, np.ndarray]:
    """Each BlockTables row's computed tokens, known tokens and last token (what a persistent batch would keep)."""
    arrays = {name: np.zeros(rows, dtype=np.int64) for name in ("computed", "tokens", "last")}
    for s in seqs:
        arrays["computed"][s.table_row], arrays["tokens"][s.table_row] = s.num_computed_tokens, s.num_tokens
        arrays["last"][s.table_row] = s.token_ids[-1]
    return arrays


def pack_from_rows(batch, index: np.ndarray, arrays: dict, min_rows: int):
    """pack_lengths' fields (ids, query lengths, tables, sequence lengths, sample rows and sequences) from per-row
    arrays, given each sequence's BlockTables row (`index`): no walk over the sequences but the chunks'."""
    starts = arrays["computed"][index]
    query_lens = np.array(batch.num_new_tokens, dtype=np.int64)
    seq_lens, ends = starts + query_lens, np.cumsum(query_lens)
    ids = np.empty(int(ends[-1]), dtype=np.int64)
    ids[ends - 1] = arrays["last"][index]  # a decode row's token (a chunk's is overwritten with its slice below)
    chunks = np.flatnonzero(query_lens > 1)
    if len(chunks):
        ids[np.repeat(query_lens > 1, query_lens)] = np.concatenate(
            [chunk_ids(batch.seqs[i], int(starts[i]), int(seq_lens[i])) for i in chunks.tolist()])
    tables = batch.block_tables.gather(index, min_rows)
    padded_lens = np.zeros(max(len(index), min_rows), dtype=np.int32)
    padded_lens[:len(index)] = seq_lens
    done = np.flatnonzero(seq_lens == arrays["tokens"][index])
    sample_seqs = list(batch.seqs) if len(done) == len(index) else list(map(batch.seqs.__getitem__, done.tolist()))
    return ids, query_lens, tables, padded_lens, ends[done] - 1, sample_seqs


def best_interleaved(rows, repeat: int, number: int = 300) -> dict[str, float]:
    """Each row's best round, the rows taking turns round by round (so a drift of the CPU meets them all)."""
    times = {name: [] for name, _ in rows}
    for _ in range(repeat):
        for name, fn in rows:
            times[name].append(timeit.timeit(fn, number=number) / number * 1e6)
    return {name: min(t) for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--chunks", type=int, default=6, help="of the requests, how many prefill a chunk")
    p.add_argument("--chunk-len", type=int, default=256)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--base", default=None, metavar="DIR", help="a checkout whose pack_lengths is timed beside this one's")
    args = p.parse_args()
    decoding, prefilling, tables = make_batch(args.requests, args.chunks, args.chunk_len)
    seqs = prefilling + decoding  # (the scheduler puts chunks first)
    batch = ScheduledBatch(seqs, [args.chunk_len] * len(prefilling) + [1] * len(decoding), block_tables=tables)
    packed = pack_lengths(batch, args.requests)
    # the step in flight sampled every decoding request, in its own order
    out = types.SimpleNamespace(token_ids=torch.arange(len(decoding)))
    prev = InFlightStep(None, decoding, out, [], None, {s.seq_id: i for i, s in enumerate(decoding)})
    for s in decoding:
        s.num_pending = 1

    def tracked(step_seqs):
        tracker = DecodeTracker()
        tracker.next_step(decoding)
        for s in decoding:
            s.token_ids.append(1)
        try:
            return tracker.next_step(step_seqs)
        finally:
            for s in decoding:
                s.token_ids.pop()

    assert tracked(decoding) is not None and tracked(decoding[1:]).src is not None
    rows = [("pack_lengths (a mixed step)", lambda: pack_lengths(batch, args.requests)),
            ("feed (rows from pack_lengths)", lambda: prev.feed(seqs, packed.last_rows, "cpu", packed.table_rows)),
            ("DecodeTracker: record, then the same batch one on", lambda: tracked(decoding)),
            ("DecodeTracker: record, then one request fewer (gathered)", lambda: tracked(decoding[1:]))]
    index = packed.table_rows
    arrays = per_row_arrays(seqs, len(tables.lens))
    for got, want in zip(pack_from_rows(batch, index, arrays, args.requests),
                         (packed.ids, packed.query_lens, packed.tables, packed.seq_lens, packed.sample_rows,
                          packed.sample_seqs)):
        assert (got == want) if isinstance(got, list) else np.array_equal(got, want)
    rows.append(("pack from per-row arrays, given the rows (a persistent batch)",
                 lambda: pack_from_rows(batch, index, arrays, args.requests)))
    if args.base:
        base = base_pack_lengths(args.base)
        np.testing.assert_array_equal(base(batch, args.requests).ids, packed.ids)
        rows.insert(1, (f"pack_lengths, {args.base}'s", lambda: base(batch, args.requests)))
    print(f"# {args.requests} requests ({args.chunks} prompt chunks of {args.chunk_len}), torch {torch.__version__}; "
          f"best of {args.repeat} rounds of 300 calls, µs")
    print("| host function | µs |")
    print("|---|---|")
    for name, us in best_interleaved(rows, args.repeat).items():
        print(f"| {name} | {us:.1f} |")


if __name__ == "__main__":
    main()
