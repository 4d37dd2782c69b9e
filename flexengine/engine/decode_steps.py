"""A pure decode step from the decode CUDA graphs (compile/cuda_graphs.py), ModelRunner's steps whose every row is a
request's last token:
  decode_from_graphs   the batch as the graphs last saw it moved on one token (only ids and new pages sent),
                       or that batch less the requests that left (run_gathered: rows gathered on the device),
                       or else the whole batch packed in one copy (run_decode_graph)
  execute_multi_step   several decode steps back to back, each fed the last one's samples on the device
Kept apart from model_runner.py's mixed and eager steps; they read the runner's graphs, tracker, sampler and feed.
"""
from __future__ import annotations

from functools import partial

import numpy as np
import torch

from .block_tables import table_rows
from .decode_inputs import MovedOn, pack_decode
from .in_flight import InFlightStep, feed_inputs
from .scheduler import ScheduledBatch
from .sequence import Sequence


class DecodeGraphSteps:
    """ModelRunner's decode-graph steps (a mixin: self is the runner)."""

    def run_decode_graph(self, seqs: list[Sequence], feed=None, block_tables=None, rows=None) -> torch.Tensor:
        """A whole decode batch from the decode graphs: ids, positions, slots, lengths and tables in ONE host→device
        copy (decode_inputs.pack_decode), which the graph unpacks itself (cuda_graphs.take_inputs). rows: the
        sequences' rows of `block_tables`, when the caller has them."""
        g = self.decode_graphs
        packed = pack_decode(seqs, self.block_size, columns=g.bufs.max_bs, block_tables=block_tables, rows=rows)
        return g.run(packed, len(seqs), self.attention_params(seqs), feed=feed)

    def decode_from_graphs(self, seqs: list[Sequence], prev: InFlightStep | None, block_tables=None) -> torch.Tensor:
        """Logits of a pure decode step from the decode graphs; when the batch is the last one's moved on one
        token (or that less the requests that left: run_gathered), only the ids and new pages go to the device
        (decode_inputs.py)."""
        moved = self.decode_tracker.next_step(seqs)
        if moved is not None and moved.src is not None:  # the last batch less the requests that left
            logits = self.run_gathered(moved, prev)
            if logits is not None:
                return logits
            moved = None  # (the tracker holds `seqs`, which the whole pack below writes)
        # a whole batch packed reads the sequences' table rows: found once, for the feed too
        rows = table_rows(seqs) if moved is None and block_tables is not None else None
        fed = self.feed(prev, seqs, None, rows)  # (None: row i is sequence i's last token)
        if moved is None:
            return self.run_decode_graph(seqs, feed=partial(feed_inputs, fed=fed), block_tables=block_tables,
                                         rows=rows)
        if fed is not None and fed[0] is None and len(fed[1]) == len(seqs):
            # every row's input is the last step's sample, on the device (async scheduling's steady state):
            # the buffers take it as it is, with no placeholder ids sent and overwritten
            return self.decode_graphs.run_moved_on(fed[1], moved.new_pages)
        ids = self.to_device(moved.ids)
        feed_inputs(ids, fed)
        return self.decode_graphs.run_moved_on(ids, moved.new_pages)

    def run_gathered(self, moved: MovedOn, prev: InFlightStep | None) -> torch.Tensor | None:
        """Logits of a decode step whose batch is the last one's with some requests gone (or in another order): the
        graph takes each row from its place in the last batch, fed the last step's sample there (or, with no step
        in flight, the ids sent). None where it cannot: per-request mod parameters (their buffers are not gathered),
        or a step in flight that is not the last batch's."""
        graphs = self.decode_graphs
        if graphs.bufs.params:
            return None
        if prev is None:
            ids = np.zeros(len(moved.last_seqs), dtype=np.int64)
            ids[moved.src] = moved.ids
            return graphs.run_moved_on(self.to_device(ids), moved.new_pages, moved.src)
        if prev.seqs != moved.last_seqs:  # (each of those sequences waits on its row's sample)
            return None
        return graphs.run_moved_on(prev.out.token_ids, moved.new_pages, moved.src)

    def decode_with_graphs(self, batch: ScheduledBatch) -> bool:
        g = self.decode_graphs
        return (g is not None and all(n == 1 for n in batch.num_new_tokens)
                and all(s.num_computed_tokens == s.num_tokens - 1 for s in batch.seqs)
                and g.bucket_for(len(batch.seqs)) is not None)

    @torch.inference_mode()
    def execute_multi_step(self, batch: ScheduledBatch) -> torch.Tensor:
        """batch.num_steps decode steps back to back, each fed the last one's samples on the device:
        → token ids [num_steps, n]. The scheduler made it only where the graphs serve every row."""
        assert self.decode_with_graphs(batch), "a multi-step batch the decode graphs cannot run"
        self.decode_tracker.forget()  # run_next moves the buffers on num_steps times
        sampling = self.sampling.tensors(batch.seqs)
        tokens = [self.sampler(self.run_decode_graph(batch.seqs, block_tables=batch.block_tables), sampling).token_ids]
        for k in range(1, batch.num_steps):
            step_k = self.sampling.step_on(sampling, batch.seqs, tokens[-1], k)  # penalties see the tokens so far
            tokens.append(self.sampler(self.decode_graphs.run_next(tokens[-1]), step_k).token_ids)
        return torch.stack(tokens)
