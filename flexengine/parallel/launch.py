"""Starting the tensor-parallel ranks, and ending them.

`start_tensor_parallel(config, model_path)` on the engine's process: checks the request (a ValueError
naming the numbers, before any process starts), spawns one worker process per extra rank (torch
multiprocessing, spawn context), and joins the group as rank 0. Under torchrun (RANK / WORLD_SIZE in
the environment) no process is spawned: every rank builds the engine and the env:// rendezvous joins
them (see parallel/worker.py for what ranks > 0 then do).

A worker that dies ends the engine: the next (or the current) step raises a RuntimeError that names it,
the other workers are killed, and the group is left; no process stays behind.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import socket
import time
import weakref

import torch

from ..config import EngineConfig, env_all_reduce, env_dist_backend, resolve_device
from .state import SINGLE, TPGroup, building_for, destroy_tensor_parallel, init_tensor_parallel, tp_group

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0   # a worker loads its shard (and on a GPU compiles) within this
STOP_TIMEOUT_S = 10.0     # then it is killed


def check_tensor_parallel(config: EngineConfig, model_path: str) -> None:
    """Everything that can be wrong with a TP request, as a ValueError, before any process starts."""
    n = config.tensor_parallel_size
    device = resolve_device(config.device)
    backend = env_dist_backend()
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError(f"FLEXENGINE_DIST_BACKEND=nccl needs CUDA, and this machine has none "
                         f"(torch.cuda.device_count() = {torch.cuda.device_count()}); use gloo on the CPU")
    if device.type == "cuda":
        visible = torch.cuda.device_count()
        first = device.index or 0
        if first + n > visible:
            raise ValueError(f"tensor_parallel_size={n} needs {n} GPUs (cuda:{first}..cuda:{first + n - 1}), but "
                             f"{visible} {'is' if visible == 1 else 'are'} visible")
    elif backend == "nccl":
        raise ValueError(f"FLEXENGINE_DIST_BACKEND=nccl runs on CUDA devices, but device={config.device!r}")
    if env_all_reduce() in ("one_shot", "torch_one_shot") and device.type != "cuda":
        raise ValueError(f"FLEXENGINE_ALL_REDUCE={env_all_reduce()} reads the other GPUs' memory: it needs CUDA "
                         f"devices, but device={config.device!r} (unset it, or set it to nccl)")
    from ..models.default_model import resolve_named_model
    from ..models.gguf import find_gguf
    gguf = find_gguf(resolve_named_model(model_path))
    if gguf is not None:
        raise ValueError(f"tensor_parallel_size={n}: tensor parallelism reads slices of safetensors checkpoints, "
                         f"and {gguf} is a GGUF file (run it with tensor_parallel_size=1)")
    # Build the model's rank-0 shard on the meta device: every divisibility rule of the sharded layers
    # (attention heads, KV heads, MLP and vocabulary sizes) raises here, with its numbers.
    from transformers import AutoConfig
    from ..models.registry import get_model_class
    hf_config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"), building_for(TPGroup(rank=0, size=n)):
        get_model_class(hf_config)(hf_config)
    dump_config(config)  # settings the workers cannot get fail here


def dump_config(config: EngineConfig) -> bytes:
    """The settings as the workers get them: by value with cloudpickle where installed (mods made by
    closures, sliding_window(W) or alibi(slopes), pickle), else by reference with pickle."""
    try:
        import cloudpickle
        dumps, how = cloudpickle.dumps, "cloudpickle"
    except ImportError:
        dumps, how = pickle.dumps, "pickle (pip install cloudpickle to send closures and lambdas)"
    try:
        return dumps(config)
    except Exception as e:
        raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size}: the engine's settings go to the "
                         f"worker processes by {how}, and they do not pickle ({type(e).__name__}: {e}); pass "
                         f"mask_mod / score_mod as registered names or module-level functions") from e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(config: EngineConfig, rank: int) -> str:
    device = resolve_device(config.device)
    return f"cuda:{(device.index or 0) + rank}" if device.type == "cuda" else device.type


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def start_tensor_parallel(config: EngineConfig, model_path: str) -> tuple[TPGroup, "WorkerPool | None"]:
    """(this process's group, the other ranks as rank 0 sees them, or None). At size 1: (SINGLE, None),
    nothing started. A spawned worker building its runner gets its group and None; under torchrun, ranks
    > 0 get a pool marked `serve_here` (the runner then serves rank 0's steps, parallel/driver.py)."""
    n = config.tensor_parallel_size
    if n == 1:
        return SINGLE, None
    if tp_group().size > 1:
        if not tp_group().is_driver and not launched_by_torchrun():
            return tp_group(), None  # a spawned worker building its runner
        raise ValueError(f"this process already runs rank {tp_group().rank} of a tensor-parallel engine; "
                         f"shut that engine down (llm.llm_engine.shutdown()) before starting another")
    check_tensor_parallel(config, model_path)
    if launched_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != n:
            raise ValueError(f"tensor_parallel_size={n}, but torchrun started WORLD_SIZE={world} processes")
        rank = int(os.environ["RANK"])
        pool = WorkerPool(n)
        pool.tp = init_tensor_parallel(rank, n, torch.device(rank_device(config, rank)), "env://")
        pool.serve_here = rank > 0
        return pool.tp, pool
    pool = WorkerPool(n)
    try:
        pool.spawn(config, model_path)
        tp = pool.join_as_driver()
    except BaseException:
        pool.shutdown()
        raise
    return tp, pool


class WorkerFailed(RuntimeError):
    pass


class WorkerPool:
    """The ranks 1..N-1 as rank 0 sees them: the worker processes it spawned (none under torchrun)."""

    def __init__(self, size: int):
        self.size = size
        self.procs, self.conns = [], []
        self.failed: WorkerFailed | None = None
        self.tp: TPGroup | None = None
        self.serve_here = False  # torchrun's ranks > 0: this process is a worker
        self.depth = 0  # > 0 while rank 0 runs a step the workers were told about (nested calls pass through)
        self.joined: list[TPGroup] = []  # the group this pool's rank 0 joined, until it leaves it
        self.before_leaving = lambda: None  # drops rank 0's CUDA graphs (set by driver.drive_workers)
        self.saved_threads: int | None = None  # rank 0's CPU threads before the engine took its share

    def spawn(self, config: EngineConfig, model_path: str) -> None:
        from .worker import worker_main
        ctx = torch.multiprocessing.get_context("spawn")
        self.rank0_device = rank_device(config, 0)
        self.init_method = f"tcp://127.0.0.1:{free_port()}"
        for rank in range(1, self.size):
            worker_config = dump_config(dataclasses.replace(config, model=model_path, device=rank_device(config, rank)))
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(rank, self.size, worker_config, self.init_method, child),
                               name=f"flexengine-tp{rank}", daemon=True)
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        # An engine that fails to start (or is dropped) after this still ends its workers and the group.
        weakref.finalize(self, reap, self.procs, self.joined)

    def join_as_driver(self) -> TPGroup:
        self.wait_for("joining")  # a worker that fails to import or start says so instead of hanging the rendezvous
        if torch.device(self.rank0_device).type == "cpu":  # every rank its share of the cores, as each worker takes
            share = max(1, (os.cpu_count() or 1) // self.size)
            if torch.get_num_threads() > share:
                # rank 0's threads spinning on every core starve the workers it waits for in each collective
                # (CPU TP=2 decode on 2 cores: 17.1 ms/token with rank 0 on both, 9.8 ms with one each)
                logger.info("tensor parallelism on the CPU: rank 0 uses %d of %d threads while the engine runs",
                            share, torch.get_num_threads())
                self.saved_threads = torch.get_num_threads()
                torch.set_num_threads(share)
        self.tp = init_tensor_parallel(0, self.size, torch.device(self.rank0_device), self.init_method)
        self.joined.append(self.tp)
        return self.tp

    def wait_for(self, what: str, timeout: float = START_TIMEOUT_S) -> None:  # (torchrun: nothing to wait for)
        """Each worker's `what` message; a worker that dies or reports an error first raises WorkerFailed."""
        deadline = time.monotonic() + timeout
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            while not conn.poll(0.05):
                if not proc.is_alive():
                    raise self.fail(f"tensor-parallel worker rank {rank} exited (code {proc.exitcode}) while starting")
                if time.monotonic() > deadline:
                    raise self.fail(f"tensor-parallel worker rank {rank} did not start within {timeout:.0f} s")
            try:
                message = conn.recv()
            except EOFError:  # it closed its end without a word: it died
                proc.join(STOP_TIMEOUT_S)
                raise self.fail(f"tensor-parallel worker rank {rank} exited (code {proc.exitcode}) while starting")
            if message[0] == "error":
                raise self.fail(f"tensor-parallel worker rank {rank} failed while starting:\n{message[1]}")
            assert message[0] == what, (message, what)

    # ------------------------------------------------------------ liveness and failure
    def dead_worker(self) -> str | None:
        for rank, proc in enumerate(self.procs, start=1):
            if proc.exitcode is not None:
                return f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
        return None

    def fail(self, reason: str, cause: BaseException | None = None) -> WorkerFailed:
        """End every rank and return the error to raise (the same one for every later call)."""
        if self.failed is None:
            detail = self.worker_errors()
            self.failed = WorkerFailed(f"{reason}; the tensor-parallel engine has stopped and cannot run more "
                                       f"steps (start a new one){detail}")
            if cause is not None:
                self.failed.__cause__ = cause
            self.kill()
        return self.failed

    def worker_errors(self) -> str:
        lines = []
        for rank, conn in enumerate(self.conns, start=1):
            with contextlib.suppress(Exception):
                while conn.poll(0):
                    message = conn.recv()
                    if message[0] == "error":
                        lines.append(f"\nworker rank {rank}: {message[1]}")
        return "".join(lines)

    @contextlib.contextmanager
    def step(self):
        """A call that involves every rank. Rank 0's messages are sent only at the outermost one; any
        failure inside ends the engine (the ranks are out of step after it)."""
        if self.failed is not None:
            raise self.failed
        dead = self.dead_worker()
        if dead:
            raise self.fail(dead)
        self.depth += 1
        try:
            yield self.depth == 1
        except WorkerFailed:
            raise
        except Exception as e:
            time.sleep(0.2)  # a worker killed mid-collective: let its exit code show
            raise self.fail(self.dead_worker() or f"a step failed on rank 0 ({type(e).__name__}: {e})", e) from e
        finally:
            self.depth -= 1

    # ------------------------------------------------------------ shutdown
    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(STOP_TIMEOUT_S)
        self.close_group()

    def close_group(self, peer_died: bool = True) -> None:
        """Leave the group, after dropping rank 0's CUDA graphs (NCCL waits for them to go)."""
        if self.tp is not None:
            self.tp = None
            self.joined.clear()
            self.before_leaving()
            with contextlib.suppress(Exception):
                destroy_tensor_parallel(peer_died)

    def shutdown(self) -> None:
        """Tell the workers to stop and leave the group with them (NCCL's teardown is collective), wait for
        them, kill any that does not stop. Idempotent."""
        if self.failed is None and self.tp is not None and all(p.is_alive() for p in self.procs):
            from .driver import send, stopped_together
            try:
                send(self.tp, ("stop",), self.conns)
                stopped_together(self.tp, STOP_TIMEOUT_S)
                self.close_group(peer_died=False)  # while the workers leave too
            except Exception as e:
                logger.warning("tensor-parallel workers did not stop cleanly (%s: %s)", type(e).__name__, e)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                logger.warning("tensor-parallel worker %s did not stop within %.0f s: killed", proc.name,
                               STOP_TIMEOUT_S)
                proc.kill()
                proc.join(STOP_TIMEOUT_S)
        self.close_group()
        for conn in self.conns:
            conn.close()
        self.conns = []
        if self.saved_threads is not None:
            torch.set_num_threads(self.saved_threads)
            self.saved_threads = None
        if self.failed is None:
            self.failed = WorkerFailed("this tensor-parallel engine was shut down; start a new one")


def reap(procs, joined: list[TPGroup]) -> None:
    """Kill what is left of a pool nobody holds any more, and leave its group if it is still joined."""
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(STOP_TIMEOUT_S)
    if joined and tp_group() is joined[0]:
        with contextlib.suppress(Exception):
            destroy_tensor_parallel(peer_died=True)


def agree_on_min(value: int, tp: TPGroup) -> int:
    """The smallest of every rank's value (each rank measures its own free memory for the KV cache)."""
    if tp.size == 1:
        return value
    import torch.distributed as dist
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.control)
    return int(t.item())
