"""The API process's side of the engine: requests go to the engine process, its step outputs come back.

The engine runs in its own process (engine_process.py), so this process's GIL serves the event loop
alone. Handlers' new requests and aborts are sent in one message per turn of the event loop; the
engine process answers with one message per step, which the event loop reads when the pipe is
readable (no thread) and routes each row (what one completion gained in the step) to its request
group. A handler gets those rows, not cumulative outputs: rebuilding every request's text and token list
at every step was the API process's largest cost at 256 streams. Each request's state keeps the totals,
appended in place, for the final response, the usage and /metrics. An abort reaches the engine process
before its next step, which frees the pages.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field

from flexengine.outputs import CompletionDelta, CompletionOutput, RequestOutput
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
    """One engine request as this process sees it: timings, and its outputs so far (rows appended)."""
    request_id: str
    arrival: float
    completions: list[CompletionOutput]  # text stays "" here: the pieces are in texts
    texts: list[list[str]]
    prompt: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    first_token: float | None = None
    last_token: float | None = None
    num_cached_tokens: int = 0
    num_unfinished: int = 0
    prompt_logprobs: list | None = None

    @classmethod
    def new(cls, request_id: str, arrival: float, n: int, logprobs: bool) -> "RequestState":
        return cls(request_id, arrival, [CompletionOutput(i, "", [], logprobs=[] if logprobs else None) for i in range(n)],
                   [[] for _ in range(n)], num_unfinished=n)

    def add(self, row: CompletionDelta) -> bool:
        """Append one row; False (and nothing appended) when it says nothing new: no token, no text, no
        finish, or a completion that already finished (the engine repeats finished ones while the
        request's other completions run)."""
        c = self.completions[row.index]
        if row.prompt_logprobs is not None:
            self.prompt_logprobs = row.prompt_logprobs
        if c.finish_reason is not None or not (row.token_ids or row.text or row.finish_reason):
            return False
        self.texts[row.index].append(row.text)
        c.token_ids += row.token_ids
        if row.logprobs is not None:
            c.logprobs += row.logprobs
        c.cumulative_logprob, c.finish_reason, c.stop_reason = row.cumulative_logprob, row.finish_reason, row.stop_reason
        self.num_cached_tokens = row.num_cached_tokens
        self.num_unfinished -= row.finish_reason is not None
        return True

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0

    def output(self) -> RequestOutput:
        """The cumulative RequestOutput, as LLMEngine.step returns it (copies: built once per request)."""
        completions = [CompletionOutput(c.index, "".join(parts), list(c.token_ids), c.cumulative_logprob,
                                        None if c.logprobs is None else list(c.logprobs), c.finish_reason, c.stop_reason)
                       for c, parts in zip(self.completions, self.texts)]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions, self.finished,
                             prompt_logprobs=self.prompt_logprobs, num_cached_tokens=self.num_cached_tokens)


def merge(first: CompletionDelta, then: CompletionDelta) -> CompletionDelta:
    """One row for two consecutive rows of the same completion."""
    return first._replace(text=first.text + then.text, token_ids=first.token_ids + then.token_ids,
                          logprobs=None if first.logprobs is None else first.logprobs + then.logprobs,
                          cumulative_logprob=then.cumulative_logprob, finish_reason=then.finish_reason,
                          stop_reason=then.stop_reason, num_cached_tokens=then.num_cached_tokens,
                          prompt_logprobs=first.prompt_logprobs or then.prompt_logprobs)


class RequestGroup:
    """The engine requests of one HTTP request (a completion may carry several prompts)."""

    def __init__(self, engine: "AsyncEngine | None", states: list[RequestState]):
        self.engine = engine
        self.states = states
        self.request_ids = [state.request_id for state in states]
        self.index_of = {rid: i for i, rid in enumerate(self.request_ids)}
        self.queue: asyncio.Queue = asyncio.Queue()
        self.unfinished = set(self.request_ids)  # as the handler has seen them (deltas() updates it)
        # completions whose finish row the handler has not seen yet, per request
        self.running = {state.request_id: len(state.completions) for state in states}
        self.aborted = False

    def deliver(self, row: CompletionDelta) -> bool:
        """Append a row to its request's state and queue it for the handler; False when it said nothing."""
        if not self.states[self.index_of[row.request_id]].add(row):
            return False
        self.queue.put_nowait((row.request_id, row))
        return True

    def results(self) -> list[RequestOutput]:
        """Each prompt's cumulative output so far (the final ones once deltas() has ended)."""
        return [state.output() for state in self.states]

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

    async def deltas(self):
        """Yield (prompt index, row) until every request finished or the group was aborted. Each
        completion's rows are new text and tokens; its last one carries the finish_reason.

        When several rows of one completion wait in the queue (the handler fell behind the engine) they
        are merged into one: one chunk instead of one per step, which keeps a busy event loop from
        falling further behind.
        """
        while self.unfinished and not self.aborted:
            waiting = [await self.queue.get()]
            while not self.queue.empty():
                waiting.append(self.queue.get_nowait())
            merged: dict[tuple[str, int], CompletionDelta] = {}
            for rid, item in waiting:
                if item is ABORTED:
                    return
                if isinstance(item, BaseException):
                    self.abort()
                    raise item
                key = (rid, item.index)
                merged[key] = merge(merged[key], item) if key in merged else item
            for (rid, _), row in merged.items():
                if row.finish_reason is not None:  # once per completion: RequestState.add drops repeats
                    self.running[rid] -= 1
                    if not self.running[rid]:
                        self.unfinished.discard(rid)
                yield self.index_of[rid], row

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
        now = time.perf_counter()
        states = [RequestState.new(f"req-{next(self._ids)}", now, params.n, params.logprobs is not None)
                  for _ in prompts]
        group = RequestGroup(self, states)
        for state, prompt in zip(states, prompts):
            self.groups[state.request_id] = group
            self.requests[state.request_id] = state
            self._outbox.new.append(NewRequest(state.request_id, prompt, params))
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
        # A broken pipe (the engine process is gone) is dropped there: _read sees EOF and fails every request.
        if not self.process.send(message):
            self.loop.add_writer(self.process.writer.fd, self._flush_pipe)

    def _flush_pipe(self) -> None:
        """Runs on the event loop when the input pipe has room for what it did not take before."""
        if self.process.flush():
            self.loop.remove_writer(self.process.writer.fd)

    def _forget(self, request_id: str, finish_reason: str | None) -> None:
        del self.groups[request_id]
        state = self.requests.pop(request_id)
        if finish_reason is not None:
            self.metrics.observe_finished(state.arrival, state.first_token, state.last_token,
                                          len(state.prompt_token_ids),
                                          [len(c.token_ids) for c in state.completions], finish_reason)

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
        for row in step.deltas:
            group = self.groups.get(row.request_id)
            if group is None or not group.deliver(row):
                continue
            state = self.requests[row.request_id]
            if row.token_ids:  # for TTFT and TPOT
                if state.first_token is None:
                    state.first_token = now
                state.last_token = now
            if state.finished:
                self._forget(row.request_id, finish_reason=state.completions[0].finish_reason)

    def _accept(self, accepted: Accepted) -> None:
        state = self.requests.get(accepted.request_id)
        if state is None:
            return
        state.prompt, state.prompt_token_ids = accepted.prompt, accepted.prompt_token_ids
        self.groups[accepted.request_id].queue.put_nowait((accepted.request_id, ADDED))

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
            self.loop.remove_writer(self.process.writer.fd)  # before stop() closes it
            self._reading = False
