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

Health (what a server reports): `self_test` runs one internal request through the
engine before serving, so a broken executable set fails the start. While serving, the
core is *degraded* after `unhealthy_after` consecutive requests failed in the engine
(finish_reason "error") and healthy again when a request succeeds; while degraded and
idle it sends itself an internal probe request every `probe_interval_s`, so a server
that balancers stopped sending traffic to can still recover. `on_health(ok)` callbacks
hear each change. An unrecoverable fault (`healthy` False, `on_fatal`) is final.
"""

from __future__ import annotations

import itertools
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


class SelfTestFailed(RuntimeError):
    """The start-up request failed in the engine: the server must not report SERVING."""


PROBE_PARAMS = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
SELF_TEST_MAX_STEPS = 64  # a 2-token request needs a handful of steps; more means a wedged engine


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
    the GIL and usually re-acquires first: a caller could wait many engine steps (on a
    CPU a submit waited up to 237 steps, 1.1 s; on an H100 at 16 req/s, TTFT p50 84 ms
    before the fair hand-over, 17.5 ms after). Callers count themselves in before they
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
                 idle_sleep_s: float = 0.001, unhealthy_after: int = 3, probe_interval_s: float = 5.0):
        if unhealthy_after < 0:
            raise ValueError(f"{unhealthy_after=} must be >= 0 (0: never degraded)")
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
        # Degraded: the last `unhealthy_after` requests all failed in the engine (module doc).
        self.unhealthy_after, self.probe_interval_s = unhealthy_after, probe_interval_s
        self.consecutive_failures = 0
        self.degraded = False
        # callbacks(ok: bool) on each change, on the loop thread with the lock held (so a
        # client that saw its request fail then sees the new health); must not call the core
        self.on_health: list = []
        self._probes = itertools.count()
        self._last_probe = 0.0

    def start(self) -> EngineCore:
        self._thread.start()
        return self

    def self_test(self) -> None:
        """Run one internal request (a short prompt, 2 greedy tokens: a prefill and a
        decode step, with their samplers) through the engine before the loop starts.
        Raises SelfTestFailed, one line, if it fails in the engine or does not finish."""
        assert not self._thread.is_alive(), "self_test runs before start()"
        eng = self.engine
        try:
            rid = eng.add_request(prompt_token_ids=self._probe_prompt(), params=PROBE_PARAMS,
                                  request_id="self-test")
            for _ in range(SELF_TEST_MAX_STEPS):
                if not eng.has_unfinished():
                    break
                for d in eng.step():
                    if d.request_id == rid and d.finish_reason == "error":
                        raise SelfTestFailed(eng.last_fault or "the engine failed it")
            else:
                raise SelfTestFailed(f"not finished after {SELF_TEST_MAX_STEPS} steps")
        except SelfTestFailed as err:
            raise SelfTestFailed(f"start-up self-test request failed: {err}") from None
        except Exception as err:
            raise SelfTestFailed(f"start-up self-test request failed: {type(err).__name__}: "
                                 f"{' '.join(str(err).split())}") from err

    def _probe_prompt(self) -> list[int]:
        """A short prompt (less than a page: nothing enters the prefix cache)."""
        sc = self.engine.plan.scheduler
        n = max(1, min(4, sc.page_size - 1, sc.max_model_len - PROBE_PARAMS.max_tokens))
        return [1 + i % (self.engine.model_config.vocab_size - 1) for i in range(n)]

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

    @property
    def load(self) -> int:
        """Live requests, read without the lock (a data-parallel server's routing: an
        estimate that never waits for a step)."""
        return len(self._streams)

    def holds(self, request_id: str) -> bool:
        """Whether `request_id` is live here, read without the lock (finding a request's replica)."""
        return request_id in self._streams

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
                    health = self._count_outcomes(deltas)
                    if health is not None:  # before the streams see the deltas (lock held)
                        for cb in self.on_health:
                            cb(health)
                    for d in deltas:
                        stream = self._streams.get(d.request_id)
                        if stream is not None:
                            stream._put(d)
                            if d.finished:
                                del self._streams[d.request_id]
                elif self.engine.background_ready():  # idle: take the background compile in
                    self.engine.install_background()
                elif (self.degraded and self._accepting
                      and time.monotonic() - self._last_probe >= self.probe_interval_s):
                    self._probe()
            self._lock.yield_to_waiters()
            if busy:
                for cb in self.on_step:
                    cb(deltas, dt)
            else:
                self._wake.wait(timeout=0.05)
                self._wake.clear()

    def _count_outcomes(self, deltas: list[RequestDelta]) -> bool | None:
        """Count consecutive requests failed in the engine; the new health if it changed."""
        was = self.degraded
        for d in deltas:
            if not d.finished or d.finish_reason == "abort":
                continue
            if d.finish_reason == "error":
                self.consecutive_failures += 1
            else:
                self.consecutive_failures = 0
        self.degraded = bool(self.unhealthy_after) and self.consecutive_failures >= self.unhealthy_after
        if self.degraded == was:
            return None
        if self.degraded:
            log.warning("engine degraded: %d consecutive requests failed in the engine",
                        self.consecutive_failures)
        else:
            log.warning("engine serving again: a request succeeded")
        return not self.degraded

    def _probe(self) -> None:
        """While degraded and idle: an internal request (no stream) whose outcome counts."""
        self._last_probe = time.monotonic()
        try:
            self.engine.add_request(prompt_token_ids=self._probe_prompt(), params=PROBE_PARAMS,
                                    request_id=f"health-probe-{next(self._probes)}")
        except Exception:  # the loop must go on: a client's success restores health too
            log.exception("health probe not submitted")

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
