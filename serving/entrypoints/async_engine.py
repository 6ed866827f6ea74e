"""The engine core seen from an asyncio event loop: submit, watch deltas, abort.

Both serving fronts use this: the OpenAI HTTP front (`serving.entrypoints.openai`) and
the gRPC front (`serving.entrypoints.grpc`) each run on their own asyncio event loop in
their own thread, with one `AsyncEngineClient` each; the engine loop runs in the
`EngineCore` thread. Calls that take the core's lock (submit, abort) can
wait for a whole engine step, so they run in a small thread pool, never on the
event loop. Deltas reach the loop without a thread per request: after every step
the core's `on_step` hook schedules ONE callback on the event loop (one
`call_soon_threadsafe` per step, whatever the batch) that wakes the requests that
got deltas; each request then drains its `RequestStream` queue without blocking.
Deltas that do not come from a step (an abort at shutdown, a failed engine) are
picked up by a poll every POLL_S, which also checks whether the client is gone.
Detokenization stays where the engine does it (on the engine thread, overlapped with
the next device step); the fronts encode (JSON and SSE, protobuf) on their loops, off the
engine thread.
The engine thread's cost per step is therefore one check (and, when the front has
requests that got deltas, one `call_soon_threadsafe`), not a thread wake-up per request:
that keeps the fronts' Python work from competing with the engine loop for the GIL at
every token (benchmarks/front_overhead.py). This module knows nothing of HTTP, gRPC or
their schemas.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from serving.engine.engine_core import EngineCore, EngineStopped, RequestStream
from serving.engine.outputs import RequestDelta
from serving.entrypoints.validation import EngineRequest

POLL_S = 0.1  # how often a waiting request re-checks its queue and its client


class ErrorDelta(RequestDelta):
    """The last delta of a request that the core failed without a delta of its own."""

    def __init__(self, request_id: str, error: str):
        super().__init__(request_id, [], "", None, True, "error", 0, 0)
        self.error = error


class AsyncEngineClient:
    """One front's view of the core; `bind(loop)` once the front's loop runs."""

    def __init__(self, core: EngineCore, workers: int = 4, name: str = "engine-client"):
        self.core = core
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: dict[str, asyncio.Event] = {}
        core.on_step.append(self._on_step)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver wake-ups to `loop` (the front's, once it runs)."""
        self._loop = loop

    def close(self) -> None:
        if self._on_step in self.core.on_step:
            self.core.on_step.remove(self._on_step)
        self._pool.shutdown(wait=False)

    # -- engine thread ---------------------------------------------------------------------

    def _on_step(self, deltas: list[RequestDelta], seconds: float) -> None:
        loop = self._loop
        if loop is None or not self._events or not deltas:
            return
        with contextlib.suppress(RuntimeError):  # the loop closed (shutdown)
            loop.call_soon_threadsafe(self._wake, [d.request_id for d in deltas])

    # -- event loop ------------------------------------------------------------------------

    def _wake(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            event = self._events.get(rid)
            if event is not None:
                event.set()

    async def submit(self, req: EngineRequest) -> RequestStream:
        """Queue one request (QueueFull, EngineStopped, ValueError as `EngineCore.submit`)."""
        call = partial(self.core.submit, params=req.params, prompt_token_ids=req.prompt_token_ids,
                       request_id=req.request_id)
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    async def stats(self) -> dict[str, object]:
        """`EngineCore.stats` (it takes the core's lock) from the pool."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.core.stats)

    def abort_soon(self, request_ids: list[str]) -> None:
        """Abort these requests from the pool (frees their pages and slots); returns at once."""
        for rid in request_ids:
            self._pool.submit(self.core.abort, rid)

    def watch(self, streams: list[RequestStream]) -> Watch:
        return Watch(self, streams)


class Watch:
    """The deltas of one or several requests of one call (HTTP or gRPC), as they arrive; `close` aborts the
    requests that have not finished (a client gone, an error) and stops watching."""

    def __init__(self, client: AsyncEngineClient, streams: list[RequestStream]):
        self.client, self.streams = client, streams
        self.live = set(range(len(streams)))
        self.event = asyncio.Event()
        self._asked = time.monotonic()  # when `gone` was last asked
        for s in streams:
            client._events[s.request_id] = self.event

    @property
    def done(self) -> bool:
        return not self.live

    def _drain(self) -> list[tuple[int, RequestDelta]]:
        out = []
        for i in sorted(self.live):
            stream = self.streams[i]
            while True:
                try:
                    delta = stream.get(timeout=0)
                except queue.Empty:
                    break
                except (RuntimeError, EngineStopped) as err:
                    delta = ErrorDelta(stream.request_id, str(err))
                out.append((i, delta))
                if delta.finished:
                    self.live.discard(i)
                    break
        return out

    async def next(self, gone: Callable[[], Awaitable[bool]] | None = None
                   ) -> list[tuple[int, RequestDelta]] | None:
        """The next deltas (index in `streams`, delta), waiting for them; None once the
        client is gone (`gone()` is asked at most every POLL_S, deltas flowing or not)."""
        while True:
            if gone is not None and time.monotonic() - self._asked > POLL_S:
                self._asked = time.monotonic()
                if await gone():
                    return None
            self.event.clear()  # before draining: a wake-up after the drain is not lost
            got = self._drain()
            if got or self.done:
                return got
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_S):
                    await self.event.wait()

    def close(self) -> None:
        for s in self.streams:
            self.client._events.pop(s.request_id, None)
        if self.live:
            self.client.abort_soon([self.streams[i].request_id for i in self.live])
            self.live.clear()
