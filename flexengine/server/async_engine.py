"""The API process's side of the engine: requests go to the engine process, its step outputs come back.

The engine runs in its own process (engine_process.py), so this process's GIL serves the event loop
alone. Handlers' new requests and aborts are sent in one message per turn of the event loop; the
engine process answers with one message per step, which the event loop reads when the pipe is
readable (no thread) and routes to the request groups as cumulative RequestOutputs, as LLMEngine.step
returns them. An abort reaches the engine process before its next step, which frees the pages.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field

from flexengine.outputs import CompletionOutput, RequestOutput
from flexengine.sampling_params import SamplingParams
from flexengine.server.engine_process import (
    Accepted, EngineFailed, EngineInput, EngineProcess, EngineSnapshot, NewRequest, StepOutputs)
from flexengine.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

ADDED = "added"      # the engine accepted the request
ABORTED = "aborted"  # the group was aborted: iteration ends


class EngineOverloadedError(RuntimeError):
    """More requests in flight than --max-num-seqs + --max-waiting-requests: the server answers 429."""


class EngineDeadError(RuntimeError):
    """The engine process died; every request in flight fails with it."""


@dataclass
class RequestState:
    """One engine request as this process sees it: timings, and the outputs so far (deltas applied)."""
    arrival: float
    completions: list[CompletionOutput]
    prompt: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    first_token: float | None = None
    last_token: float | None = None
    last_output: RequestOutput | None = None
    num_cached_tokens: int = 0


class RequestGroup:
    """The engine requests of one HTTP request (a completion may carry several prompts)."""

    def __init__(self, engine: "AsyncEngine", request_ids: list[str]):
        self.engine = engine
        self.request_ids = request_ids
        self.index_of = {rid: i for i, rid in enumerate(request_ids)}
        self.queue: asyncio.Queue = asyncio.Queue()
        self.unfinished = set(request_ids)
        self.aborted = False

    @property
    def finished(self) -> bool:
        return not self.unfinished or self.aborted

    async def wait_added(self) -> None:
        """Wait until the engine accepted every prompt; raise its ValueError (and abort the rest) if not."""
        pending = set(self.request_ids)
        while pending:
            rid, item = await self.queue.get()
            if isinstance(item, BaseException):
                self.abort()
                raise item
            if item is ABORTED:
                return
            assert item is ADDED, f"output before acceptance for {rid}"
            pending.discard(rid)

    async def outputs(self):
        """Yield (prompt index, RequestOutput) until every request finished or the group was aborted.

        Outputs are cumulative, so when several of one request wait in the queue (the handler fell
        behind the engine) only the latest is yielded: one delta instead of one per step, which keeps a
        busy event loop from falling further behind. The latest also carries any finish_reason.
        """
        while self.unfinished and not self.aborted:
            waiting = [await self.queue.get()]
            while not self.queue.empty():
                waiting.append(self.queue.get_nowait())
            latest: dict[str, RequestOutput] = {}
            for rid, item in waiting:
                if item is ABORTED:
                    return
                if isinstance(item, BaseException):
                    self.abort()
                    raise item
                if item.finished:
                    self.unfinished.discard(rid)
                latest[rid] = item
            for rid, item in latest.items():
                yield self.index_of[rid], item

    def abort(self) -> None:
        """Abort what is still running (client gone, handler cancelled); idempotent."""
        if self.finished:
            return
        self.aborted = True
        for rid in list(self.unfinished):
            self.engine.abort(rid)
        self.unfinished.clear()
        self.queue.put_nowait((None, ABORTED))


class AsyncEngine:
    def __init__(self, process: EngineProcess, max_num_seqs: int, max_waiting_requests: int,
                 metrics: ServerMetrics | None = None):
        self.process = process
        self.tokenizer = process.ready.tokenizer
        self.max_model_len = process.ready.max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_waiting_requests = max_waiting_requests
        self.metrics = metrics or ServerMetrics()
        self.snapshot: EngineSnapshot = process.ready.snapshot
        self.error: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        # engine request id -> its group and state
        self.groups: dict[str, RequestGroup] = {}
        self.requests: dict[str, RequestState] = {}
        self._ids = itertools.count()
        self._outbox = EngineInput()  # sent once per turn of the event loop
        self._flush_scheduled = False
        self._reading = False

    @property
    def num_in_flight(self) -> int:
        return len(self.groups)

    @property
    def num_waiting(self) -> int:
        # The engine runs at most max_num_seqs at once; the rest wait in its queue.
        return max(0, self.num_in_flight - self.max_num_seqs)

    @property
    def alive(self) -> bool:
        return self.error is None and self.process.is_alive()

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.loop.add_reader(self.process.reader.fd, self._read)
        self._reading = True

    def stop(self) -> None:
        """Stop reading and stop the engine process (it exits after its step in flight); idempotent."""
        self._stop_reading()
        self.process.stop()

    def add_requests(self, prompts: list, params: SamplingParams) -> RequestGroup:
        """Queue prompts for the engine; raises EngineOverloadedError past the load limit."""
        if self.error is not None:
            raise EngineDeadError(str(self.error))
        limit = self.max_num_seqs + self.max_waiting_requests
        if self.num_in_flight + len(prompts) > limit:
            self.metrics.requests_rejected.inc()
            raise EngineOverloadedError(
                f"server is at its load limit ({self.num_in_flight} requests in flight, limit {limit}); "
                f"retry later")
        self.metrics.requests_received.inc(len(prompts))
        request_ids = [f"req-{next(self._ids)}" for _ in prompts]
        group = RequestGroup(self, request_ids)
        now = time.perf_counter()
        logprobs = params.logprobs is not None
        for rid, prompt in zip(request_ids, prompts):
            self.groups[rid] = group
            self.requests[rid] = RequestState(now, [CompletionOutput(i, "", [], logprobs=[] if logprobs else None)
                                                    for i in range(params.n)])
            self._outbox.new.append(NewRequest(rid, prompt, params))
        self._send_soon()
        return group

    def abort(self, request_id: str) -> None:
        if request_id not in self.groups:
            return
        self._forget(request_id, finish_reason="abort")
        self._outbox.aborts.append(request_id)
        self._send_soon()

    def _send_soon(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        """One message with everything handlers queued during this turn of the event loop."""
        self._flush_scheduled = False
        message, self._outbox = self._outbox, EngineInput()
        if self.error is not None or self.process.inputs.closed:
            return
        try:
            self.process.send(message)
        except BrokenPipeError:  # the engine process is gone: _read sees EOF and fails every request
            pass

    def _forget(self, request_id: str, finish_reason: str | None) -> None:
        del self.groups[request_id]
        state = self.requests.pop(request_id)
        if finish_reason is not None:
            self.metrics.observe_finished(state.arrival, state.first_token, state.last_token,
                                          state.last_output, finish_reason)

    # ---- what the engine process sends ------------------------------------------------------------

    def _read(self) -> None:
        """Runs on the event loop when the pipe is readable: every message that arrived, in order."""
        reader = self.process.reader
        for message in reader.read_available():
            if isinstance(message, EngineFailed):
                self._engine_died(message.traceback)
                return
            self._deliver(message)
        if reader.eof:
            self._engine_died(None)

    def _deliver(self, step: StepOutputs) -> None:
        """Route one step's outputs to their groups (a request aborted meanwhile is skipped: the engine
        process drops it too once the abort arrives)."""
        now = time.perf_counter()
        self.snapshot = step.snapshot
        for accepted in step.accepted:
            self._accept(accepted)
        for rid, message in step.refused:
            group = self.groups.get(rid)
            if group is not None:
                self._forget(rid, finish_reason=None)
                group.queue.put_nowait((rid, ValueError(message)))
        progressed: dict[str, RequestState] = {}
        gained: set[str] = set()  # requests that got a token this step (for TTFT/TPOT)
        for delta in step.deltas:
            state = self.requests.get(delta.request_id)
            if state is None:
                continue
            old = state.completions[delta.index]
            state.completions[delta.index] = CompletionOutput(
                delta.index, old.text + delta.text, old.token_ids + delta.token_ids,
                delta.cumulative_logprob, None if delta.logprobs is None else old.logprobs + delta.logprobs,
                delta.finish_reason, delta.stop_reason)
            state.num_cached_tokens = delta.num_cached_tokens
            progressed[delta.request_id] = state
            if delta.token_ids:
                gained.add(delta.request_id)
        for rid, state in progressed.items():
            output = RequestOutput(rid, state.prompt, state.prompt_token_ids, list(state.completions),
                                   finished=all(c.finish_reason is not None for c in state.completions),
                                   num_cached_tokens=state.num_cached_tokens)
            group = self.groups[rid]
            self._track(rid, state, output, now, rid in gained)
            group.queue.put_nowait((rid, output))

    def _accept(self, accepted: Accepted) -> None:
        state = self.requests.get(accepted.request_id)
        if state is None:
            return
        state.prompt, state.prompt_token_ids = accepted.prompt, accepted.prompt_token_ids
        self.groups[accepted.request_id].queue.put_nowait((accepted.request_id, ADDED))

    def _track(self, rid: str, state: RequestState, output: RequestOutput, now: float, gained: bool) -> None:
        if gained:
            if state.first_token is None:
                state.first_token = now
            state.last_token = now
        state.last_output = output
        if output.finished:
            reason = output.outputs[0].finish_reason if output.outputs else "stop"
            self._forget(rid, finish_reason=reason or "stop")

    def _engine_died(self, failure: str | None) -> None:
        """Fail every request in flight loudly instead of leaving handlers waiting forever."""
        self._stop_reading()
        if failure is None:
            what = f"exited unexpectedly (exit code {self.process.exit_code()})"
        else:
            logger.error("the engine process raised:\n%s", failure)
            what = f"raised {failure.strip().splitlines()[-1]}"
        self.error = EngineDeadError(f"the engine process {what}; the server cannot serve requests")
        logger.error("%s", self.error)
        for rid in list(self.groups):
            group = self.groups[rid]
            self._forget(rid, finish_reason=None)
            group.queue.put_nowait((rid, self.error))

    def _stop_reading(self) -> None:
        if self._reading:
            self.loop.remove_reader(self.process.reader.fd)
            self._reading = False
