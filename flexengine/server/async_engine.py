"""The engine loop behind the server: one thread steps LLMEngine; asyncio handlers talk to it by hand-off.

The engine is not thread-safe, so every engine call (add, abort, step) happens on the loop thread.
Handlers queue work under a lock and wake the thread; the thread hands results back to the event loop
in one `loop.call_soon_threadsafe` per step. New requests join the running batch at the next step
(continuous batching), and an abort is applied before the next step runs.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flexengine.outputs import RequestOutput
from flexengine.sampling_params import SamplingParams
from flexengine.server.metrics import ServerMetrics

if TYPE_CHECKING:
    from flexengine.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

ADDED = "added"      # the engine accepted the request
ABORTED = "aborted"  # the group was aborted: iteration ends


class EngineOverloadedError(RuntimeError):
    """More requests in flight than --max-num-seqs + --max-waiting-requests: the server answers 429."""


class EngineDeadError(RuntimeError):
    """The engine thread raised; every request in flight fails with it."""


@dataclass
class RequestTimes:
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    last_output: RequestOutput | None = None


@dataclass
class EngineSnapshot:
    """Numbers the engine thread publishes after every step, read by /metrics (plain assignments)."""
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_unfinished: int = 0


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
    def __init__(self, engine: "LLMEngine", max_num_seqs: int, max_waiting_requests: int,
                 metrics: ServerMetrics | None = None):
        self.engine = engine
        self.max_num_seqs = max_num_seqs
        self.max_waiting_requests = max_waiting_requests
        self.metrics = metrics or ServerMetrics()
        self.snapshot = EngineSnapshot(engine.num_free_blocks(), engine.num_total_blocks, 0)
        self.error: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        # Event-loop side: engine request id -> its group and timings.
        self.groups: dict[str, RequestGroup] = {}
        self.times: dict[str, RequestTimes] = {}
        self._ids = itertools.count()
        # Hand-off to the engine thread, guarded by _cond.
        self._cond = threading.Condition()
        self._new: list[tuple[str, object, SamplingParams]] = []
        self._aborts: list[str] = []
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ---- event-loop side --------------------------------------------------------------------------

    @property
    def num_in_flight(self) -> int:
        return len(self.groups)

    @property
    def num_waiting(self) -> int:
        # The engine runs at most max_num_seqs at once; the rest wait in its queue.
        return max(0, self.num_in_flight - self.max_num_seqs)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="flexengine-engine-loop", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()

    def add_requests(self, prompts: list, params: SamplingParams) -> RequestGroup:
        """Queue prompts for the engine; raises EngineOverloadedError past the load limit."""
        if self.error is not None:
            raise EngineDeadError(f"engine loop died: {self.error!r}")
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
        for rid in request_ids:
            self.groups[rid] = group
            self.times[rid] = RequestTimes(arrival=now)
        with self._cond:
            self._new.extend((rid, prompt, params) for rid, prompt in zip(request_ids, prompts))
            self._cond.notify()
        return group

    def abort(self, request_id: str) -> None:
        if request_id not in self.groups:
            return
        self._forget(request_id, finish_reason="abort")
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    def _forget(self, request_id: str, finish_reason: str | None) -> None:
        del self.groups[request_id]
        times = self.times.pop(request_id)
        if finish_reason is not None:
            self.metrics.observe_finished(times.arrival, times.first_token, times.last_token,
                                          times.last_output, finish_reason)

    def _deliver(self, events: list[tuple[str, object]]) -> None:
        """Runs on the event loop: route the engine thread's events to their groups."""
        now = time.perf_counter()
        for rid, item in events:
            group = self.groups.get(rid)
            if group is None:  # aborted meanwhile; the engine thread drops it too
                continue
            if isinstance(item, RequestOutput):
                self._track(rid, item, now)
            elif isinstance(item, BaseException):
                self._forget(rid, finish_reason=None)
            group.queue.put_nowait((rid, item))

    def _track(self, rid: str, output: RequestOutput, now: float) -> None:
        times = self.times[rid]
        new_tokens = sum(len(c.token_ids) for c in output.outputs)
        old_tokens = sum(len(c.token_ids) for c in times.last_output.outputs) if times.last_output else 0
        if new_tokens > old_tokens:
            if times.first_token is None:
                times.first_token = now
            times.last_token = now
        times.last_output = output
        if output.finished:
            reason = output.outputs[0].finish_reason if output.outputs else "stop"
            self._forget(rid, finish_reason=reason or "stop")

    # ---- engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        busy = False
        try:
            while True:
                with self._cond:
                    while not (self._new or self._aborts or busy or self._stopping):
                        self._cond.wait()
                    if self._stopping:
                        return
                    new, self._new = self._new, []
                    aborts, self._aborts = self._aborts, []
                events: list[tuple[str, object]] = []
                for rid in aborts:  # the engine ignores ids it no longer holds
                    self.engine.abort_request(rid)
                for rid, prompt, params in new:
                    if rid in aborts:
                        continue
                    try:
                        self.engine.add_request(rid, prompt, params)
                    except ValueError as e:  # a bad prompt (too long, bad ids): the handler answers 400
                        events.append((rid, e))
                        continue
                    events.append((rid, ADDED))
                if self.engine.has_unfinished_requests():
                    events.extend((output.request_id, output) for output in self.engine.step())
                busy = self.engine.has_unfinished_requests()
                self._publish_snapshot()
                if events:
                    self.loop.call_soon_threadsafe(self._deliver, events)
        except BaseException as e:
            # Fail every request in flight loudly instead of leaving handlers waiting forever.
            logger.exception("engine loop died")
            self.error = e
            self.loop.call_soon_threadsafe(self._fail_all, EngineDeadError(f"engine loop died: {e!r}"))
            raise

    def _publish_snapshot(self) -> None:
        self.snapshot = EngineSnapshot(self.engine.num_free_blocks(), self.engine.num_total_blocks,
                                       self.engine.get_num_unfinished_requests())

    def _fail_all(self, error: BaseException) -> None:
        self._deliver([(rid, error) for rid in list(self.groups)])
