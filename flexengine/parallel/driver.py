"""Rank 0's side of a step: before each device call that every rank makes, tell the workers what to run.

`drive_workers(runner, pool)` wraps, on rank 0's ModelRunner only, the calls a step makes on the model:
run_model (an eager step), model.compute_logits (sampling, prompt logprobs), the decode graphs' run /
run_next / run_moved_on and the mixed graphs' run. Each sends a small pickled description (down each spawned
worker's pipe; under torchrun over the control group, gloo) and broadcasts the step's device tensors over the
device group; the worker (parallel/worker.py)
makes the same call on its shard. Rank 0's input ids reach the workers inside the model (they may have
been fed from rank 0's samples on the device), so no row of the step ever leaves the device.
The scheduler, the block manager and the sampler exist on rank 0 alone: only rank 0 samples.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .state import TPGroup


def send(tp: TPGroup, message: tuple, conns=()) -> None:
    """A step's description to the workers: down the pipe of each worker rank 0 spawned, which returns as soon
    as the bytes are written (17 µs on the CPU machine of session 17, where a gloo broadcast held rank 0 for
    278 µs a message); over the control group where torchrun started the ranks (no pipes)."""
    if conns:
        for conn in conns:
            conn.send(message)
    else:
        dist.broadcast_object_list([message], src=0, group=tp.control)


def receive(tp: TPGroup, conn=None) -> tuple:
    if conn is not None:
        return conn.recv()  # EOFError once rank 0 has gone
    box = [None]
    dist.broadcast_object_list(box, src=0, group=tp.control)
    return box[0]


def stopped_together(tp: TPGroup, timeout_s: float = 10.0) -> None:
    """Every rank has read the stop message before any leaves the group (a rank that leaves while another
    still reads from it can abort that one's process at exit)."""
    import datetime
    dist.monitored_barrier(group=tp.control, timeout=datetime.timedelta(seconds=timeout_s))


def specs(tensors: list[torch.Tensor]) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return [(tuple(t.shape), t.dtype) for t in tensors]


def broadcast_tensors(tp: TPGroup, tensors: list[torch.Tensor]) -> None:
    """The step's tensors as ONE broadcast of their bytes (one collective per step, not one per tensor)."""
    if tensors:
        parts = []
        for t in tensors:
            raw = t.contiguous().view(-1).view(torch.uint8)
            parts.append(torch.nn.functional.pad(raw, (0, padded(raw.numel()) - raw.numel())))
        dist.broadcast(torch.cat(parts), src=0, group=tp.device)


def padded(nbytes: int) -> int:
    """Each tensor starts on an 8-byte boundary of the packed bytes, so it can be viewed as its dtype."""
    return -(-nbytes // 8) * 8


def receive_tensors(tp: TPGroup, wanted: list[tuple[tuple[int, ...], torch.dtype]], device) -> list[torch.Tensor]:
    if not wanted:
        return []
    sizes = [math.prod(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in wanted]
    packed = torch.empty(sum(map(padded, sizes)), dtype=torch.uint8, device=device)
    dist.broadcast(packed, src=0, group=tp.device)
    parts = packed.split(list(map(padded, sizes)))
    return [part[:n].view(dtype).view(shape) for part, n, (shape, dtype) in zip(parts, sizes, wanted)]


def forward_tensors(positions, meta) -> tuple[list[str], list[torch.Tensor]]:
    names = sorted(meta.params)
    return names, [positions, meta.block_tables, meta.seq_lens, meta.slot_mapping, *(meta.params[n] for n in names)]


def drive_workers(runner, pool) -> None:
    """Once the workers have built their runners: make rank 0's runner tell them each device call
    before it makes it (see the module doc), and stop them when the runner goes."""
    import weakref
    runner_ref = weakref.ref(runner)  # the pool must not keep the runner alive
    pool.before_leaving = lambda: (runner := runner_ref()) is not None and runner.release_graphs()
    if pool.serve_here:  # torchrun's rank > 0: this process is a worker from here on, then it ends
        from .worker import serve_steps
        serve_steps(runner, pool.tp)
        pool.close_group(peer_died=False)
        raise SystemExit(0)
    runner.finalize_workers = weakref.finalize(runner, pool.shutdown)  # also at interpreter exit
    pool.wait_for("ready")
    tp = pool.tp

    def announce(message: tuple, tensors: list[torch.Tensor]) -> None:
        send(tp, message + (specs(tensors),), pool.conns)
        broadcast_tensors(tp, tensors)

    run_model = runner.run_model

    def run_model_tp(input_ids, positions, meta):
        with pool.step() as outermost:
            if outermost:
                names, tensors = forward_tensors(positions, meta)
                announce(("forward", input_ids.shape[0], meta.layout, meta.block_size, meta.num_blocks, names),
                         tensors)
            return run_model(input_ids, positions, meta)

    compute_logits = runner.model.compute_logits

    def compute_logits_tp(hidden, float32: bool = True):
        with pool.step() as outermost:
            if outermost:
                announce(("logits",), [hidden])  # (the workers' part, the vocabulary gather, is the same either way)
            return compute_logits(hidden, float32)

    runner.run_model = run_model_tp
    runner.model.compute_logits = compute_logits_tp
    if runner.decode_graphs is not None:
        wrap_decode_graphs(runner.decode_graphs, pool, announce)
    if runner.mixed_graphs is not None:
        wrap_mixed_graphs(runner.mixed_graphs, pool, announce)


def wrap_decode_graphs(graphs, pool, announce) -> None:
    run, run_next, run_moved_on = graphs.run, graphs.run_next, graphs.run_moved_on

    def run_tp(packed, n, params, feed=None):
        with pool.step() as outermost:
            if outermost:  # the packed batch: a host array, pickled (rank 0's ids reach the workers in the model)
                names = sorted(params)
                announce(("decode", packed, n, names), [params[name] for name in names])
            return run(packed, n, params, feed=feed)

    def run_next_tp(token_ids):
        with pool.step() as outermost:
            if outermost:
                announce(("decode_next", token_ids.shape[0]), [])
            return run_next(token_ids)

    def run_moved_on_tp(token_ids, new_pages):
        with pool.step() as outermost:
            if outermost:  # the new pages: a host array, pickled
                announce(("decode_moved", token_ids.shape[0], new_pages), [])
            return run_moved_on(token_ids, new_pages)

    graphs.run, graphs.run_next, graphs.run_moved_on = run_tp, run_next_tp, run_moved_on_tp


def wrap_mixed_graphs(graphs, pool, announce) -> None:
    run = graphs.run

    def run_tp(ids, query_lens, seq_lens, tables, key, params, feed=None):
        with pool.step() as outermost:
            if outermost:  # host arrays, pickled; the parameters are on the device
                names = sorted(params)
                announce(("mixed", len(ids), query_lens, seq_lens, tables, key, names), [params[n] for n in names])
            return run(ids, query_lens, seq_lens, tables, key, params, feed=feed)

    graphs.run = run_tp
