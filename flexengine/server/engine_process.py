"""The engine in its own process, so that the API process's GIL belongs to the event loop alone.

The child (spawned: CUDA cannot be used in a forked child) builds LLMEngine from the EngineConfig and
loops: apply the requests and aborts that arrived, run one step, send ONE message with what every
request gained in that step (new token ids, text, finish) and a snapshot for /metrics. Whole
RequestOutputs would repeat the prompt and every token so far: about 7 us to unpickle per request and
step on the API side, against about 1.3 for a delta (measured at 256 prompt tokens).

    process = EngineProcess.start(config)   # returns once the engine is built
    process.send(EngineInput(new=[NewRequest(...)], aborts=[]))   # False: the rest waits for flush()
    process.reader.read_available()         # StepOutputs, one per step; process.reader.eof once it is gone
    process.stop()                          # closing its input pipe is what tells the child to exit

The child's loop does its own pipe work, without blocking, between steps: it reads every input that
arrived (so an abort that arrives mid-step is applied before the next step) and writes what the
output pipe takes, keeping the rest for later. Neither side ever blocks on a write, so two full pipes
cannot wait on each other. Helper threads did this before; while the loop was busy on the host they
got the GIL only at the interpreter's 5 ms switch interval, and requests reached the engine at about
one per 4 ms. The child also exits when the API process dies: its input pipe then reads EOF.
"""
from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import select
import signal
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from flexengine.config import EngineConfig, env_stats_interval_s
from flexengine.outputs import CompletionDelta
from flexengine.sampling_params import SamplingParams
from flexengine.server.pipe import MessageReader, MessageWriter

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0   # a step in flight finishes before the child exits; past this it is killed
MAX_UNSENT_BYTES = 4 << 20  # the API process this far behind: the engine waits for it before stepping on
READY_LOG_EVERY_S = 30.0
COMPILE_POLL_S = 0.002  # an idle engine loop's wait for a grammar compiling on the worker thread
STATS_INTERVAL_S = env_stats_interval_s()


# ---- messages ------------------------------------------------------------------------------------

@dataclass
class NewRequest:
    request_id: str
    prompt: Any                  # a str or {"prompt_token_ids": [...]}, tokenized in the child
    params: SamplingParams


@dataclass
class EngineInput:
    """API → engine: what arrived during one turn of the event loop (adds first, then aborts)."""
    new: list[NewRequest] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)


@dataclass
class EngineSnapshot:
    """The numbers /metrics shows, taken after every step."""
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_unfinished: int = 0


@dataclass
class Accepted:
    """The engine took a request: what it made of the prompt."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]


@dataclass
class StepOutputs:
    """Engine → API, one per step (or per turn with nothing to step, e.g. when only aborts arrived)."""
    accepted: list[Accepted]
    refused: list[tuple[str, str]]       # (request id, the engine's ValueError message): HTTP 400
    deltas: list[CompletionDelta]
    snapshot: EngineSnapshot

    # The rows travel as columns of plain values: pickling 256 named tuples took 205 us of the engine
    # loop's time per step, their columns 40 (CPU VM).
    def __getstate__(self):
        return self.accepted, self.refused, list(zip(*self.deltas)), self.snapshot

    def __setstate__(self, state):
        self.accepted, self.refused, columns, self.snapshot = state
        self.deltas = list(map(CompletionDelta._make, zip(*columns)))


@dataclass
class EngineReady:
    pid: int
    tokenizer: Any
    max_model_len: int
    snapshot: EngineSnapshot
    build_s: float
    frozen_objects: int  # what start-up left to the permanent GC generation (freeze_startup_heap)


@dataclass
class EngineFailed:
    """The child's last message when it raises: the traceback, for the API process's log and errors."""
    traceback: str


# ---- the child -----------------------------------------------------------------------------------

def run_engine(config: EngineConfig, inputs, outputs) -> None:
    """The engine process: build the engine, say so, step until the API process closes the input pipe."""
    # Ctrl-C reaches the whole process group; the API process decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    log_to_stderr()
    from flexengine.engine.llm_engine import LLMEngine  # here: the API process never loads the model code
    writer = MessageWriter(outputs.fileno())
    try:
        started = time.perf_counter()
        logger.info("engine process %d: building the engine (model %s)", os.getpid(), config.model or "default")
        use_one_host_thread(config.device)
        engine = LLMEngine(config)
        freeze_startup_heap()
        writer.send(EngineReady(os.getpid(), engine.tokenizer, engine.max_model_len, snapshot_of(engine),
                                time.perf_counter() - started, gc.get_freeze_count()))
        EngineLoop(engine, MessageReader(inputs.fileno()), writer).run()
    except BaseException:
        writer.send(EngineFailed(traceback.format_exc()))  # then die loudly as well
        raise
    finally:
        writer.drain(STOP_TIMEOUT_S)


def use_one_host_thread(device: str) -> None:
    """On a GPU, this process's tensor ops on the host are small copies. PyTorch would run each larger
    one on a team of threads, one per core, and a team waits for its slowest member: with the API
    process and the clients busy on the same cores, full-budget steps took about 45 ms of host time,
    30-36 ms with one thread (H100 box, session 6). vLLM sets OMP_NUM_THREADS=1 for the same reason
    (vllm/__init__.py); as there, an OMP_NUM_THREADS the user set wins. On CPU the model needs them.
    Before anything compiles: dynamo guards on the thread count, and changing it later recompiled
    every graph (and ran the GPU out of memory)."""
    from flexengine.config import resolve_device
    import torch
    if resolve_device(device).type == "cuda" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def freeze_startup_heap() -> None:
    """Leave what start-up built out of every later garbage collection. A full collection walks every
    tracked object: 124 ms for an engine of the embedded model on the CPU VM, and every step or
    stream waits for it. Serving makes few objects that live long, so after the freeze a full
    collection walks only those. Garbage first, which a freeze would keep forever. vLLM does the same
    after start-up (`freeze_gc_heap`, vllm/utils/gc_utils.py). Only in the server's own processes:
    objects frozen in a user's process (an offline LLM) would never be collected after a `del`."""
    gc.collect()
    gc.freeze()


def snapshot_of(engine) -> EngineSnapshot:
    return EngineSnapshot(engine.num_free_blocks(), engine.num_total_blocks, engine.get_num_unfinished_requests())


class LoopStats:
    """Where the engine loop's time goes, logged every few seconds while it works: waiting for the
    device (reading a step's tokens back), waiting to send (the API process is behind), waiting for
    requests, and the rest, host work (scheduling, inputs, outputs, detokenizing)."""

    def __init__(self, device_wait_s: float, compiles: int):
        self.start = time.perf_counter()
        self.steps = self.tokens = self.arrived = 0
        self.idle_s = self.send_s = 0.0
        self.device_s_at_start = device_wait_s  # the engine's running total when this interval began
        self.compiles_at_start = compiles       # graphs dynamo had compiled then (start-up compiles them all)

    def maybe_log(self, engine) -> "LoopStats":
        """Log the interval once it is long enough; → the stats to count into next."""
        elapsed = time.perf_counter() - self.start
        if elapsed < STATS_INTERVAL_S:
            return self
        busy = elapsed - self.idle_s
        if self.steps and busy > 0:
            device = engine.device_wait_s - self.device_s_at_start
            logger.info("engine: %.1f steps/s, %.0f tokens/s out, %d requests (%d arrived); of the busy time: "
                        "waiting for the device %.0f%%, waiting to send %.0f%%, host work %.0f%%", self.steps / elapsed,
                        self.tokens / elapsed, engine.get_num_unfinished_requests(), self.arrived, 100 * device / busy,
                        100 * self.send_s / busy, 100 * (busy - device - self.send_s) / busy)
        compiles = compile_count()
        if compiles > self.compiles_at_start:
            logger.warning("engine: %d graphs compiled while serving, in the last %.0f s: a shape or a global setting "
                           "that start-up did not see (each costs seconds and memory)",
                           compiles - self.compiles_at_start, elapsed)
        return LoopStats(engine.device_wait_s, compiles)


def compile_count() -> int:
    from flexengine.compile import compile_count  # here: the API process does not load torch
    return compile_count()


class EngineLoop:
    def __init__(self, engine, reader: MessageReader, writer: MessageWriter):
        self.engine, self.reader, self.writer = engine, reader, writer
        self.stats = LoopStats(engine.device_wait_s, compile_count())
        # Requests whose grammar compiles on a worker thread while the loop steps the others; each is added
        # (or refused, an invalid spec being a 400) once its compile is done.
        self.compiling: list[tuple[NewRequest, Any]] = []

    def run(self) -> None:
        while True:
            inputs = self.take_inputs()
            if inputs is None:
                return
            accepted, refused = self.apply(inputs)
            self.stats.arrived += len(accepted) + len(refused)
            deltas = self.engine.step_deltas() if self.engine.has_unfinished_requests() else []
            self.send(StepOutputs(accepted, refused, deltas, snapshot_of(self.engine)))
            self.stats.steps += bool(deltas)
            self.stats.tokens += sum(len(d.token_ids) for d in deltas)
            self.stats = self.stats.maybe_log(self.engine)

    def take_inputs(self) -> list[EngineInput] | None:
        """Everything that arrived since the last step, waiting for it when there is nothing to step
        (and writing what is left to send meanwhile); None when the API process closed the pipe."""
        got = self.reader.read_available()
        if not got and not self.reader.eof and not self.engine.has_unfinished_requests():
            started = time.perf_counter()
            while not got and not self.reader.eof and not self.compiled():
                unsent = [self.writer.fd] if self.writer.buffer else []
                select.select([self.reader.fd], unsent, [], COMPILE_POLL_S if self.compiling else None)
                self.writer.flush()
                got = self.reader.read_available()
            self.stats.idle_s += time.perf_counter() - started
        self.writer.flush()
        return None if self.reader.eof else got

    def send(self, message: StepOutputs) -> None:
        """Write the step's message, or as much as the pipe takes; wait only when the API process is far behind."""
        started = time.perf_counter()
        self.writer.send(message)
        while len(self.writer.buffer) > MAX_UNSENT_BYTES:
            self.writer.wait_writable(None)
            self.writer.flush()
        self.stats.send_s += time.perf_counter() - started

    def compiled(self) -> bool:
        return any(future.done() for _, future in self.compiling)

    def apply(self, inputs: list[EngineInput]) -> tuple[list[Accepted], list[tuple[str, str]]]:
        accepted, refused = [], []
        done = [new for new, future in self.compiling if future.done()]
        self.compiling = [(new, future) for new, future in self.compiling if not future.done()]
        for new in done:
            self.add(new, accepted, refused)
        for message in inputs:
            for new in message.new:
                future = self.engine.compile_in_background(new.params)
                if future is not None:
                    self.compiling.append((new, future))
                else:
                    self.add(new, accepted, refused)
            for request_id in message.aborts:  # the engine ignores ids it no longer holds
                self.compiling = [(new, f) for new, f in self.compiling if new.request_id != request_id]
                self.engine.abort_request(request_id)
        return accepted, refused

    def add(self, new: NewRequest, accepted: list[Accepted], refused: list[tuple[str, str]]) -> None:
        try:
            self.engine.add_request(new.request_id, new.prompt, new.params, delta=True)
        except ValueError as e:  # a bad prompt (too long, ids out of range) or grammar: the API answers 400
            refused.append((new.request_id, str(e)))
            return
        request = self.engine.requests[new.request_id]
        accepted.append(Accepted(new.request_id, request.prompt, request.prompt_token_ids))


# ---- the API process's handle --------------------------------------------------------------------

class EngineProcess:
    def __init__(self, process, inputs, outputs, reader: MessageReader, ready: EngineReady):
        self.process, self.inputs, self.ready = process, inputs, ready
        self.writer = MessageWriter(inputs.fileno())  # inputs owns the fd; only the writer writes it
        self.outputs = outputs  # owns the fd that reader reads; only the reader reads it
        self.reader = reader

    @classmethod
    def start(cls, config: EngineConfig) -> "EngineProcess":
        """Spawn the engine process and wait until it has built the engine (warm-up and compiles included)."""
        ctx = multiprocessing.get_context("spawn")
        child_inputs, inputs = ctx.Pipe(duplex=False)
        outputs, child_outputs = ctx.Pipe(duplex=False)
        # Not a daemon: a daemonic process may not start processes of its own (compile workers).
        process = ctx.Process(target=run_engine, args=(config, child_inputs, child_outputs),
                              name="flexengine-engine", daemon=False)
        started = time.perf_counter()
        process.start()
        child_inputs.close()  # the child holds these ends now: its death reads as EOF here
        child_outputs.close()
        logger.info("started the engine process (pid %d); waiting for it to build the engine", process.pid)
        reader = MessageReader(outputs.fileno())
        messages = []
        while not messages and not reader.eof:
            if not reader.wait(READY_LOG_EVERY_S):
                logger.info("engine process still building after %.0f s", time.perf_counter() - started)
            messages = reader.read_available()
        if not messages:
            process.join()
            raise RuntimeError(f"the engine process exited (exit code {process.exitcode}) before it was ready")
        assert len(messages) == 1, "the engine process says nothing after it is ready until it gets a request"
        ready = messages[0]
        if isinstance(ready, EngineFailed):
            process.join()
            raise RuntimeError(f"the engine process failed while building the engine:\n{ready.traceback}")
        assert isinstance(ready, EngineReady), f"unexpected first message {type(ready).__name__}"
        logger.info("engine ready in %.1f s (engine process %d: %d KV blocks, max_model_len %d, %d start-up objects "
                    "left out of garbage collection)", ready.build_s, ready.pid, ready.snapshot.num_total_blocks,
                    ready.max_model_len, ready.frozen_objects)
        return cls(process, inputs, outputs, reader, ready)

    @property
    def pid(self) -> int:
        return self.process.pid

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def exit_code(self) -> int | None:
        """After its pipe read EOF: the child is gone or going; reap it for its exit code."""
        self.process.join(5)
        return self.process.exitcode

    def send(self, message: EngineInput) -> bool:
        """Send without blocking; False when part of it waits for the pipe to drain (call flush() then)."""
        self.writer.send(message)
        return not self.writer.buffer

    def flush(self) -> bool:
        return self.writer.flush()

    def stop(self) -> None:
        """Close the input pipe and wait for the child to finish its step and exit; idempotent."""
        if not self.inputs.closed:
            self.inputs.close()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        # Keep reading: a child blocked sending into a full pipe would never see the close.
        while self.process.is_alive() and time.monotonic() < deadline and not self.outputs.closed:
            if self.reader.wait(0.05):
                self.reader.read_available()
                if self.reader.eof:
                    break
        self.process.join(max(0.0, deadline - time.monotonic()))
        if self.process.is_alive():
            logger.warning("engine process %d did not exit in %.0f s; killing it", self.pid, STOP_TIMEOUT_S)
            self.process.kill()
            self.process.join()
        if not self.outputs.closed:
            self.outputs.close()


def log_to_stderr() -> None:
    """flexengine's INFO logs (engine start-up, notices) on stderr, for the server and its engine process."""
    root = logging.getLogger("flexengine")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(processName)s %(name)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
