"""The engine core: `LLMEngine.step` in a background thread, with thread-safe submit and abort.

Servers (gRPC) and other concurrent callers use this: `submit` validates and queues a
request and returns a `RequestStream` that yields the request's deltas as the loop
produces them; `abort` frees the request's pages and slot at once (within the current
step). All engine calls happen under one lock, so the scheduler (not thread-safe) is
only ever touched by one thread at a time. The lock is handed over fairly: a caller
waiting for it (submit, abort, stats) gets it between two steps, because the loop,
which would otherwise take it back at once (Python's lock has no queue), yields
to waiting callers first. A bounded waiting queue makes `submit`
raise `QueueFull` when too many requests wait; accepted requests are never dropped.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator

from serving.engine.llm_engine import LLMEngine
from serving.engine.outputs import RequestDelta
from serving.sample.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The waiting queue is at its limit; the request was not accepted."""


class EngineStopped(Exception):
    """The engine core is shut down and accepts no requests."""


class RequestStream:
    """Iterate a request's deltas (blocking); the last one has finished=True."""

    def __init__(self, core: EngineCore, request_id: str):
        self.core, self.request_id = core, request_id
        self._q: queue.Queue[RequestDelta | BaseException] = queue.Queue()

    def _put(self, item: RequestDelta | BaseException) -> None:
        self._q.put(item)

    def get(self, timeout: float | None = None) -> RequestDelta:
        """The next delta; raises queue.Empty after `timeout`, or the engine's error."""
        item = self._q.get(timeout=timeout)
        if isinstance(item, BaseException):
            raise item
        return item

    def __iter__(self) -> Iterator[RequestDelta]:
        while True:
            delta = self.get()
            yield delta
            if delta.finished:
                return

    def abort(self) -> None:
        self.core.abort(self.request_id)


class _FairLock:
    """A lock whose holder in a loop can let waiting threads in before taking it back.

    `threading.Lock` wakes a waiter on release, but the releasing thread still holds
    the GIL and usually re-acquires first: a caller could wait many engine steps (a
    new request's first token late by ~100 ms under load, measured on a CPU: submit
    waited up to 1.1 s behind 5 ms steps). Callers count themselves in before they
    block; `yield_to_waiters` (called by the loop with the lock released) waits until
    they have been through, for at most `max_wait_s`.
    """

    def __init__(self, max_wait_s: float = 0.005) -> None:
        self._lock = threading.Lock()
        self._count = threading.Lock()
        self._waiting = 0
        self.max_wait_s = max_wait_s

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            with self._count:
                self._waiting += 1
            try:
                self._lock.acquire()
            finally:
                with self._count:
                    self._waiting -= 1

    def __exit__(self, *exc) -> None:
        self._lock.release()

    def yield_to_waiters(self) -> None:
        if not self._waiting:
            return
        deadline = time.perf_counter() + self.max_wait_s
        while self._waiting and time.perf_counter() < deadline:
            time.sleep(0.0001)  # releases the GIL: a waiter takes the lock and returns it


class EngineCore:
    def __init__(self, engine: LLMEngine, *, max_waiting: int | None = None,
                 idle_sleep_s: float = 0.001):
        self.engine = engine
        self.max_waiting = max_waiting
        self.idle_sleep_s = idle_sleep_s
        self._lock = _FairLock()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._stop = threading.Event()
        self._accepting = True
        self._thread = threading.Thread(target=self._loop, name="engine-core", daemon=True)
        self.step_times: list[float] = []  # recent step durations (s), for metrics
        self.on_step: list = []  # callbacks(deltas, step_seconds), called on the loop thread
        # False once the engine hit a fault it cannot recover from (device lost, every step
        # failing); then on_fatal callbacks(exception) run once, on the loop thread, and the
        # owner should stop serving (health NOT_SERVING) and exit non-zero.
        self.healthy = True
        self.fatal_error: BaseException | None = None
        self.on_fatal: list = []

    def start(self) -> EngineCore:
        self._thread.start()
        return self

    # -- callers (any thread) -------------------------------------------------------

    def submit(self, prompt: str | None = None, params: SamplingParams | None = None, *,
               prompt_token_ids: list[int] | None = None,
               request_id: str | None = None) -> RequestStream:
        """Validate and queue; ValueError names a bad field, QueueFull when the queue is full."""
        with self._lock:
            if not self._accepting:
                raise EngineStopped("the engine is shutting down")
            waiting = self.engine.scheduler.stats().num_waiting
            if self.max_waiting is not None and waiting >= self.max_waiting:
                raise QueueFull(f"{waiting} requests waiting (limit {self.max_waiting})")
            rid = self.engine.add_request(prompt, params, prompt_token_ids=prompt_token_ids,
                                          request_id=request_id)
            stream = RequestStream(self, rid)
            self._streams[rid] = stream
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> bool:
        """Abort a live request; its stream ends with an 'abort' delta. False if not live."""
        with self._lock:
            stream = self._streams.pop(request_id, None)
            seq = self.engine.scheduler.get(request_id)
            live = self.engine.abort(request_id)
        if stream is not None and live:
            n = seq.num_output_tokens if seq is not None else 0
            p = seq.num_prompt_tokens if seq is not None else 0
            stream._put(RequestDelta(request_id, [], "", None, True, "abort", p, n))
        return live

    def stats(self) -> dict[str, object]:
        with self._lock:
            return self.engine.stats()

    def stop_accepting(self) -> None:
        with self._lock:
            self._accepting = False

    def num_live(self) -> int:
        with self._lock:
            return len(self._streams)

    def shutdown(self, grace_s: float = 0.0) -> None:
        """Stop accepting; let live requests run for up to `grace_s`, abort the rest, stop."""
        self.stop_accepting()
        deadline = time.monotonic() + grace_s
        while self.num_live() and time.monotonic() < deadline:
            time.sleep(0.01)
        with self._lock:
            live = list(self._streams)
        for rid in live:
            self.abort(rid)
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()

    # -- the loop (its own thread) -----------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                busy = self.engine.has_unfinished()
                if busy:
                    t0 = time.perf_counter()
                    try:
                        deltas = self.engine.step()  # recoverable faults are isolated inside
                    except Exception as err:  # unrecoverable: fail every stream, stop, tell the owner
                        log.exception("engine cannot go on; stopping")
                        self._die(err)
                        return
                    dt = time.perf_counter() - t0
                    self.step_times = [*self.step_times[-255:], dt]
                    for d in deltas:
                        stream = self._streams.get(d.request_id)
                        if stream is not None:
                            stream._put(d)
                            if d.finished:
                                del self._streams[d.request_id]
            self._lock.yield_to_waiters()
            if busy:
                for cb in self.on_step:
                    cb(deltas, dt)
            else:
                self._wake.wait(timeout=0.05)
                self._wake.clear()

    def _die(self, err: Exception) -> None:
        """Called with the lock held: refuse new work, fail every live stream, run on_fatal."""
        self.healthy = False
        self._accepting = False
        self.fatal_error = err
        for rid, stream in list(self._streams.items()):
            self.engine.abort(rid)
            stream._put(EngineStopped(f"the engine failed and is stopping: {err}"))
        self._streams.clear()
        for cb in self.on_fatal:
            try:
                cb(err)
            except Exception:
                log.exception("on_fatal callback failed")
