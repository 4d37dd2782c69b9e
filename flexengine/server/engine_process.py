"""The engine in its own process, so that the API process's GIL belongs to the event loop alone.

The child (spawned: CUDA cannot be used in a forked child) builds LLMEngine from the EngineConfig and
loops: apply the requests and aborts that arrived, run one step, send ONE message with what every
request gained in that step (new token ids, text, finish) and a snapshot for /metrics. Whole
RequestOutputs would repeat the prompt and every token so far: about 7 us to unpickle per request and
step on the API side, against about 1.3 for a delta (measured at 256 prompt tokens).

    process = EngineProcess.start(config)   # returns once the engine is built
    process.send(EngineInput(new=[NewRequest(...)], aborts=[]))
    process.reader.read_available()         # StepOutputs, one per step; process.reader.eof once it is gone
    process.stop()                          # closing its input pipe is what tells the child to exit

A thread in the child reads the input pipe all the time, so an abort that arrives mid-step is applied
before the next step, and the child never stops reading while it waits to send (were both pipes full,
each side would wait on the other). Another thread pickles and writes the step messages
(pipe.MessageWriter), so the next step starts without waiting for them. The child also exits when the
API process dies: its input pipe then reads EOF.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from flexengine.config import EngineConfig, env_stats_interval_s
from flexengine.outputs import RequestOutput
from flexengine.sampling_params import SamplingParams
from flexengine.server.pipe import MessageReader, MessageWriter

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0   # a step in flight finishes before the child exits; past this it is killed
READY_LOG_EVERY_S = 30.0
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


class CompletionDelta(NamedTuple):
    """What one completion gained in one step. A tuple: it pickles in a third of a dataclass's time."""
    request_id: str
    index: int
    text: str                    # appended to the text (the visible text never shrinks)
    token_ids: list[int]         # new token ids
    logprobs: list | None        # one dict per new token, when asked for
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: int | str | None
    num_cached_tokens: int


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


@dataclass
class EngineReady:
    pid: int
    tokenizer: Any
    max_model_len: int
    snapshot: EngineSnapshot
    build_s: float


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
    writer = MessageWriter(outputs.fileno())  # whole messages, which the API process reads without blocking
    send = writer.send
    try:
        started = time.perf_counter()
        logger.info("engine process %d: building the engine (model %s)", os.getpid(), config.model or "default")
        engine = LLMEngine(config)
        send(EngineReady(os.getpid(), engine.tokenizer, engine.max_model_len, snapshot_of(engine),
                         time.perf_counter() - started))
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=read_inputs, args=(inputs, inbox), name="flexengine-engine-inputs",
                         daemon=True).start()
        EngineLoop(engine, inbox, send).run()
    except BaseException:
        send(EngineFailed(traceback.format_exc()))  # then die loudly as well
        raise
    finally:
        writer.close()


def read_inputs(inputs, inbox: queue.SimpleQueue) -> None:
    """Child thread: move every EngineInput into the inbox; None once the API process closed the pipe."""
    while True:
        try:
            message = inputs.recv()
        except EOFError:  # the API process stopped us, or died
            inbox.put(None)
            return
        inbox.put(message)


def snapshot_of(engine) -> EngineSnapshot:
    return EngineSnapshot(engine.num_free_blocks(), engine.num_total_blocks, engine.get_num_unfinished_requests())


class LoopStats:
    """Where the engine loop's time goes, logged every few seconds while it works: waiting for the
    device (reading a step's tokens back), waiting to send (the API process is behind), waiting for
    requests, and the rest, host work (scheduling, inputs, outputs, detokenizing)."""

    def __init__(self, device_wait_s: float):
        self.start = time.perf_counter()
        self.steps = self.tokens = 0
        self.idle_s = self.send_s = 0.0
        self.device_s_at_start = device_wait_s  # the engine's running total when this interval began

    def maybe_log(self, engine) -> "LoopStats":
        """Log the interval once it is long enough; → the stats to count into next."""
        elapsed = time.perf_counter() - self.start
        if elapsed < STATS_INTERVAL_S:
            return self
        busy = elapsed - self.idle_s
        if self.steps and busy > 0:
            device = engine.device_wait_s - self.device_s_at_start
            logger.info("engine: %.1f steps/s, %.0f tokens/s out, %d requests; of the busy time: waiting for the "
                        "device %.0f%%, waiting to send %.0f%%, host work %.0f%%", self.steps / elapsed,
                        self.tokens / elapsed, engine.get_num_unfinished_requests(), 100 * device / busy,
                        100 * self.send_s / busy, 100 * (busy - device - self.send_s) / busy)
        return LoopStats(engine.device_wait_s)


class EngineLoop:
    def __init__(self, engine, inbox: queue.SimpleQueue, send):
        self.engine, self.inbox, self.send = engine, inbox, send
        self.stats = LoopStats(engine.device_wait_s)

    def run(self) -> None:
        while True:
            inputs = self.take_inputs()
            if inputs is None:
                return
            accepted, refused = self.apply(inputs)
            outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
            deltas = [d for output in outputs for d in self.deltas(output)]
            started = time.perf_counter()
            self.send(StepOutputs(accepted, refused, deltas, snapshot_of(self.engine)))
            self.stats.send_s += time.perf_counter() - started
            self.stats.steps += bool(outputs)
            self.stats.tokens += sum(len(d.token_ids) for d in deltas)
            self.stats = self.stats.maybe_log(self.engine)

    def take_inputs(self) -> list[EngineInput] | None:
        """Everything that arrived since the last step, waiting for it when there is nothing to step;
        None when the API process closed the pipe."""
        got = []
        if not self.engine.has_unfinished_requests():
            started = time.perf_counter()
            got.append(self.inbox.get())
            self.stats.idle_s += time.perf_counter() - started
        while not self.inbox.empty():  # this loop is the only reader
            got.append(self.inbox.get())
        return None if any(message is None for message in got) else got

    def apply(self, inputs: list[EngineInput]) -> tuple[list[Accepted], list[tuple[str, str]]]:
        accepted, refused = [], []
        for message in inputs:
            for new in message.new:
                try:
                    self.engine.add_request(new.request_id, new.prompt, new.params, delta=True)
                except ValueError as e:  # a bad prompt (too long, ids out of range): the API answers 400
                    refused.append((new.request_id, str(e)))
                    continue
                request = self.engine.requests[new.request_id]
                accepted.append(Accepted(new.request_id, request.prompt, request.prompt_token_ids))
            for request_id in message.aborts:  # the engine ignores ids it no longer holds
                self.engine.abort_request(request_id)
        return accepted, refused

    def deltas(self, output: RequestOutput) -> list[CompletionDelta]:
        """The rows of a delta-mode output (added with delta=True: only what is new since the last)."""
        return [CompletionDelta(output.request_id, c.index, c.text, c.token_ids, c.logprobs, c.cumulative_logprob,
                                c.finish_reason, c.stop_reason, output.num_cached_tokens) for c in output.outputs]


# ---- the API process's handle --------------------------------------------------------------------

class EngineProcess:
    def __init__(self, process, inputs, outputs, reader: MessageReader, ready: EngineReady):
        self.process, self.inputs, self.ready = process, inputs, ready
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
        logger.info("engine ready in %.1f s (engine process %d: %d KV blocks, max_model_len %d)",
                    ready.build_s, ready.pid, ready.snapshot.num_total_blocks, ready.max_model_len)
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

    def send(self, message: EngineInput) -> None:
        self.inputs.send(message)

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
