"""A worker rank: build the same ModelRunner on this rank's shard, then make each device call rank 0
announces (parallel/driver.py) until it says stop. A worker has no scheduler, no block manager and no
sampler; its KV cache holds its own heads of the pages rank 0 hands out.

Spawned by the engine (`worker_main`), or, under torchrun, entered by `LLM(...)` on ranks > 0
(`serve_steps`, then the process exits when rank 0 stops).
"""
from __future__ import annotations

import os
import pickle
import traceback

import numpy as np
import torch

from ..attention.metadata import build_metadata
from .driver import receive, receive_tensors, stopped_together
from .state import destroy_tensor_parallel, init_tensor_parallel


def worker_main(rank: int, size: int, config_bytes: bytes, init_method: str, conn) -> None:
    """The spawned process: join the group, build the runner, serve steps. Any failure is reported on
    `conn` (rank 0 shows it) and ends the process."""
    try:
        config = pickle.loads(config_bytes)  # launch.dump_config
        device = torch.device(config.device)
        if device.type == "cpu":  # the ranks share the machine's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
        conn.send(("joining",))
        tp = init_tensor_parallel(rank, size, device, init_method)
        from ..engine.model_runner import ModelRunner
        runner = ModelRunner(config)
        conn.send(("ready",))
        serve_steps(runner, tp, conn)
        runner.release_graphs()  # then leave the group beside rank 0 (state.destroy_tensor_parallel says why)
        destroy_tensor_parallel()
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        finally:
            destroy_tensor_parallel(peer_died=True)  # rank 0 ends the engine; it does not leave beside us
            raise SystemExit(1)


@torch.inference_mode()
def serve_steps(runner, tp, conn=None) -> None:
    """Run what rank 0 announces (down `conn`, or over the control group under torchrun) until it says stop."""
    device = runner.device
    while True:
        message = receive(tp, conn)
        if message[0] == "stop":
            stopped_together(tp)
            return
        kind, *args, wanted = message
        tensors = receive_tensors(tp, wanted, device)
        if kind == "forward":
            num_tokens, layout, block_size, num_blocks, names = args
            positions, tables, seq_lens, slots, *values = tensors
            meta = build_metadata(tables, seq_lens, slots, layout, block_size, num_blocks, dict(zip(names, values)))
            meta.backend = runner.backend
            runner.backend.prepare(meta, runner.mods)
            ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)  # rank 0's arrive inside the model
            runner.run_model(ids, positions, meta)
        elif kind == "logits":
            runner.model.compute_logits(tensors[0])
        elif kind == "decode":
            packed, n, names = args
            runner.decode_graphs.run(packed, n, dict(zip(names, tensors)))
        elif kind == "decode_next":
            runner.decode_graphs.run_next(torch.zeros(args[0], dtype=torch.int64, device=device))
        elif kind == "decode_moved":
            n, new_pages = args
            runner.decode_graphs.run_moved_on(torch.zeros(n, dtype=torch.int64, device=device), new_pages)
        elif kind == "mixed":
            n, query_lens, seq_lens, tables, key, names = args
            runner.mixed_graphs.run(np.zeros(n, dtype=np.int64), query_lens, seq_lens, tables, key,
                                    dict(zip(names, tensors)))
        else:
            raise AssertionError(f"unknown step kind {kind!r}")
