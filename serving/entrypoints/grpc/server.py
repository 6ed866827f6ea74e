"""The serving process: gRPC server + engine core + health + reflection + metrics, and shutdown.

    server = GenerationServer(engine, model_name="native-tiny", port=0, metrics_port=0).start()
    ...                       # server.port / server.metrics_port are the bound ports
    server.shutdown(grace_s=30)

`GenerationServer` wires the parts together: an `EngineCore` (the engine loop
thread; given several engines, a `DataParallelCore` with one per replica), a
`grpc.aio` server on its own asyncio event loop in one thread ("grpc-aio"),
the `Generation` servicer (coroutines on that loop, fed one wake-up per engine step by an
`AsyncEngineClient`, as the HTTP front is: no thread per stream, so the fronts' Python work
does not fight the engine thread for the GIL at every token), the standard
`grpc.health.v1` service (grpc_health's asyncio servicer), server reflection, and the
Prometheus endpoint. The gRPC call limit is the open-stream limit plus spares, so
health checks and unary calls keep being answered when the streams are full. It binds
127.0.0.1 unless told otherwise, and the metrics endpoint binds the same host as gRPC. Optional TLS
(`tls`) and a shared API key (`api_key`, see `serving.entrypoints.grpc.security`; health stays open).
With `http` (an `OpenAIConfig`) the OpenAI-compatible HTTP API
(`serving.entrypoints.openai`) is served on the same host from the same engine core.
`run_until_signal` is what `hybrid-jax serve` runs: it blocks until SIGTERM or
SIGINT, then shuts down gracefully and returns 0 (the process exits 0), or until
the engine core reports a fault it cannot recover from, and then returns
`EXIT_ENGINE_FAILED` so that a supervisor restarts the process.

Health: `start` runs one internal request through the engine before it reports SERVING
(`EngineCore.self_test`); while serving, health is NOT_SERVING after `unhealthy_after`
consecutive requests failed in the engine and SERVING again once one succeeds
(`EngineCore`'s degraded rule, docs/serving.md), and NOT_SERVING for good after a fatal
fault or at shutdown.

Shutdown: health turns NOT_SERVING and new Generate calls get UNAVAILABLE; requests
in flight run for up to `grace_s`; what is left is aborted (its stream ends with
UNAVAILABLE); then the transport stops. This module knows nothing of request
validation or how deltas become messages (see `serving.entrypoints.grpc.grpc_service`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Coroutine

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from serving.engine.data_parallel import make_core
from serving.engine.engine_core import SelfTestFailed
from serving.engine.llm_engine import LLMEngine
from serving.entrypoints.async_engine import AsyncEngineClient
from serving.entrypoints.grpc.grpc_service import SERVICE, GenerationServicer, add_to_server
from serving.entrypoints.grpc.security import ApiKeyInterceptor
from serving.entrypoints.metrics import ServerMetrics
from serving.entrypoints.openai.api_server import OpenAIConfig, OpenAIServer
from serving.entrypoints.request_log import log_event
from serving.entrypoints.validation import RequestLimits, default_request_bytes

SERVICE_NAME = SERVICE  # "hybrid_jax.v1.Generation"
SPARE_CALLS = 16  # concurrent calls beyond the open streams: health, unary calls, rejections
EXIT_ENGINE_FAILED = 1  # run_until_signal's answer when the engine cannot recover
UNHEALTHY_AFTER = 3  # consecutive requests failed in the engine before health says NOT_SERVING
FATAL_DRAIN_S = 2.0  # after such a fault: NOT_SERVING answered, then the transport closes


class GenerationServer:
    """One engine served over gRPC on `host:port` (port 0 picks a free one).

    max_waiting bounds the engine's waiting queue (RESOURCE_EXHAUSTED beyond it).
    max_streams bounds the open Generate calls (default: every stream that can be
    admitted, max_num_seqs + max_waiting); one more gets RESOURCE_EXHAUSTED from the
    servicer, counted. gRPC itself takes max_streams + SPARE_CALLS concurrent calls and
    refuses more (RESOURCE_EXHAUSTED, uncounted) rather than queue them invisibly.
    limits: per-request size limits (default: `RequestLimits` with a request-size
    limit from max_model_len). tls: server credentials (`security.tls_credentials`).
    api_key: calls other than health checks need `authorization: Bearer <api_key>`.
    unhealthy_after: consecutive requests failed in the engine before health turns
    NOT_SERVING (0: never for that reason); while so and idle, the engine probes itself
    every probe_interval_s. self_test: run the start-up request.
    """

    def __init__(self, engine: LLMEngine | list[LLMEngine], *, model_name: str, host: str = "127.0.0.1",
                 port: int = 0,
                 metrics_port: int | None = None, max_waiting: int = 128, max_streams: int | None = None,
                 limits: RequestLimits | None = None, tls: grpc.ServerCredentials | None = None,
                 api_key: str | None = None, unhealthy_after: int = UNHEALTHY_AFTER, self_test: bool = True,
                 probe_interval_s: float = 5.0, http: OpenAIConfig | None = None):
        engines = engine if isinstance(engine, list) else [engine]
        # Several engines (data_parallel_size > 1): one DataParallelCore over them
        # (serving/engine/data_parallel.py); one: the plain EngineCore.
        self.core = make_core(engines, max_waiting=max_waiting, unhealthy_after=unhealthy_after,
                              probe_interval_s=probe_interval_s)
        engine = engines[0]
        self._self_test = self_test
        self.metrics = ServerMetrics(self.core.stats)
        self.core.on_step.append(self.metrics.on_step)
        self.limits = limits or RequestLimits(
            max_request_bytes=default_request_bytes(engine.plan.scheduler.max_model_len))
        streams = max_streams or sum(e.plan.scheduler.max_num_seqs + max_waiting for e in engines)
        self._loop = _LoopThread("grpc-aio")  # the gRPC front's event loop, from here on
        self.client = AsyncEngineClient(self.core, name="grpc-engine")
        self.health = None
        try:
            self._grpc = self._loop.run(self._build(streams, api_key, model_name))
            self.port = self._loop.run(self._bind(host, port, tls))
        except BaseException:
            self._loop.stop()
            self.client.close()
            raise
        self.host = host
        self._metrics_port_arg = metrics_port
        self.metrics_port: int | None = None
        self.model_name = model_name
        self._stopped = threading.Event()
        self._wake = threading.Event()  # a signal or a fatal engine fault: run_until_signal returns
        self.fatal_error: BaseException | None = None
        self.core.on_fatal.append(self._on_fatal)  # the engine cannot recover
        self._serving = False
        # The OpenAI HTTP front: same host, engine core, metrics, limits and API key; its
        # /health answers from is_serving() (the rule gRPC health follows too).
        try:
            self.http = None if http is None else OpenAIServer(
                self.core, self.metrics, http, host=host, limits=self.limits, api_key=api_key,
                health=self.is_serving)
        except BaseException:  # its port is in use: release gRPC's too
            self._close_transport(None)
            raise
        self.http_port = None if self.http is None else self.http.port
        self.core.on_health.append(self._on_health)  # degraded / serving again

    async def _build(self, streams: int, api_key: str | None, model_name: str) -> grpc.aio.Server:
        """The aio server and its services (on the loop: grpc.aio binds a server to the
        loop it is made on)."""
        self.client.bind(asyncio.get_running_loop())
        interceptors = [ApiKeyInterceptor(api_key, self._unauthenticated)] if api_key else []
        calls = streams + SPARE_CALLS
        server = grpc.aio.server(
            interceptors=interceptors, maximum_concurrent_rpcs=calls,
            options=[("grpc.so_reuseport", 0),  # a second server on the same port fails to bind
                     # bodies up to twice the limit reach the servicer, which refuses them counted
                     ("grpc.max_receive_message_length", 2 * self.limits.max_request_bytes)])
        add_to_server(GenerationServicer(self.core, self.metrics, model_name=model_name, limits=self.limits,
                                         max_streams=streams, client=self.client), server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME),
                                            server)
        return server

    async def _bind(self, host: str, port: int, tls: grpc.ServerCredentials | None) -> int:
        addr = f"{host}:{port}"
        try:
            bound = self._grpc.add_secure_port(addr, tls) if tls else self._grpc.add_insecure_port(addr)
        except RuntimeError as err:  # grpc's "Failed to bind to address ..."
            raise OSError(f"cannot listen on {addr}: the port is in use or the host is not an "
                          "address of this machine (--host, --port)") from err
        if bound == 0:
            raise OSError(f"could not bind {addr}")
        return bound

    def start(self) -> GenerationServer:
        """Run the self-test request, start the engine loop, the metrics endpoint and the
        gRPC server; report SERVING. A failed self-test raises `SelfTestFailed` (nothing
        was started: the caller exits)."""
        if self._self_test:
            t0 = time.monotonic()
            try:
                self.core.self_test()
            except SelfTestFailed:
                self._close_transport(None)  # release the bound port
                raise
            log_event("server.self_test", seconds=round(time.monotonic() - t0, 3))
        self.core.start()
        if self._metrics_port_arg is not None:
            self.metrics_port = self.metrics.start_http(self._metrics_port_arg, addr=self.host)
        self._loop.run(self._grpc.start())
        if self.http is not None:
            self.http.start()
        self._serving = True
        self._set_health(health_pb2.HealthCheckResponse.SERVING, wait=True)
        engine = self.core.engine
        log_event("server.started", model=self.model_name, host=self.host, port=self.port,
                  metrics_port=self.metrics_port, http_port=self.http_port,
                  weight_bytes=sum(engine.weight_bytes_by_dtype.values()),
                  weight_bytes_by_dtype=engine.weight_bytes_by_dtype)
        return self

    def shutdown(self, grace_s: float = 30.0) -> None:
        """Stop accepting, let in-flight requests finish for `grace_s`, abort the rest, stop.

        Idempotent. Aborted streams end with UNAVAILABLE; the transport then gets a few
        seconds to deliver those statuses before it closes. The gRPC front's event loop
        serves throughout, and stops last.
        """
        if self._stopped.is_set():
            return
        self._stopped.set()
        live = self.core.num_live()
        log_event("server.stopping", in_flight=live, grace_s=grace_s)
        self._serving = False
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING, wait=True)
        t0 = time.monotonic()
        self.core.shutdown(grace_s)  # stop accepting, wait up to grace_s, abort the rest
        if self.http is not None:
            self.http.stop()
        self._close_transport(5.0)
        self.metrics.stop_http()
        log_event("server.stopped", in_flight_at_signal=live, seconds=round(time.monotonic() - t0, 3))

    def _on_fatal(self, err: BaseException) -> None:
        """The engine cannot recover: NOT_SERVING at once, wake run_until_signal.

        Runs on the engine thread with the core's lock held (the core already refuses new
        work), so it must not call back into the core.
        """
        if self.fatal_error is None:
            self.fatal_error = err
            log_event("server.fatal", logging.CRITICAL, error=repr(err))
        self._serving = False
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self._wake.set()

    def is_serving(self) -> bool:
        """True while the engine serves: started, not shutting down, no unrecoverable fault,
        not degraded (EngineCore's consecutive-failure rule).
        HTTP /health answers 200 exactly while this holds (503 otherwise)."""
        return (self._serving and self.core.healthy and not self.core.degraded
                and not self._stopped.is_set())

    def _on_health(self, ok: bool) -> None:
        """Degraded or serving again (EngineCore's rule); a stopped or failed server stays
        NOT_SERVING. On the loop thread with the core's lock held: no calls into the core."""
        if self._stopped.is_set() or self.fatal_error is not None:
            return
        log_event("server.health", logging.INFO if ok else logging.WARNING,
                  status="SERVING" if ok else "NOT_SERVING",
                  consecutive_failed_requests=self.core.consecutive_failures)
        self._set_health(health_pb2.HealthCheckResponse.SERVING if ok
                         else health_pb2.HealthCheckResponse.NOT_SERVING)

    def _unauthenticated(self, method: str, token_given: bool) -> None:
        self.metrics.rejected.labels("UNAUTHENTICATED", "unauthenticated").inc()
        log_event("request.rejected", logging.WARNING, code="UNAUTHENTICATED", reason="unauthenticated",
                  method=method, token_given=token_given)

    def _set_health(self, status: int, wait: bool = False) -> None:
        """Set both health entries on the loop. Without `wait` it returns at once (the engine
        thread calls this with the core's lock held: it must never wait for the loop); the
        change still lands before the loop hears of the step that caused it, since both go
        through the loop's queue in order."""
        async def put() -> None:
            for name in ("", SERVICE_NAME):
                await self.health.set(name, status)

        with contextlib.suppress(RuntimeError, TimeoutError):  # the loop has stopped (after shutdown)
            if wait:
                self._loop.run(put(), timeout=10)
            else:
                self._loop.loop.call_soon_threadsafe(lambda: self._loop.loop.create_task(put()))

    def _close_transport(self, grace_s: float | None) -> None:
        """Stop the gRPC server (calls still open after `grace_s` are cancelled), then its loop."""
        with contextlib.suppress(RuntimeError, TimeoutError):  # stopped before; a wedged loop
            self._loop.run(self._grpc.stop(grace_s), timeout=(grace_s or 0) + 10)
        self._loop.stop()
        self.client.close()

    def run_until_signal(self, grace_s: float = 30.0) -> int:
        """Block until SIGTERM or SIGINT (main thread only), then shut down gracefully: 0.

        When the engine core reports an unrecoverable fault (its `on_fatal` callbacks, or
        `healthy` turning False) health is already NOT_SERVING; the server keeps answering
        (NOT_SERVING, UNAVAILABLE) for FATAL_DRAIN_S, stops and returns EXIT_ENGINE_FAILED.
        """
        previous = {s: signal.signal(s, lambda signum, frame: self._wake.set())
                    for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            while not self._wake.wait(timeout=0.5):
                if not self.core.healthy:  # belt and braces: on_fatal should have woken us
                    self._on_fatal(self.core.fatal_error or RuntimeError("the engine core is not healthy"))
            if self.fatal_error is None:
                log_event("server.signal", grace_s=grace_s)
                self.shutdown(grace_s)
                return 0
            # Drain: health answers NOT_SERVING (so balancers see it) and every stream
            # gets its status before the transport closes.
            time.sleep(min(grace_s, FATAL_DRAIN_S))
            self._shutdown_bounded(0.0)
            log_event("server.exit", logging.CRITICAL, code=EXIT_ENGINE_FAILED,
                      reason="the engine cannot recover; restart the process")
            return EXIT_ENGINE_FAILED
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _shutdown_bounded(self, grace_s: float) -> None:
        """Shut down, but give up waiting after grace_s + 10 s (a wedged engine thread)."""
        stopper = threading.Thread(target=self.shutdown, args=(grace_s,), daemon=True)
        stopper.start()
        stopper.join(timeout=grace_s + 10.0)


class _LoopThread:
    """An asyncio event loop running in its own daemon thread; `run` a coroutine on it
    from any other thread and wait for its result."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine, timeout: float | None = 60.0):
        if self.loop.is_closed() or not self._thread.is_alive():
            coro.close()
            raise RuntimeError("the gRPC event loop has stopped")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        """Stop the loop (idempotent): cancel what still runs on it, then close it."""
        if self.loop.is_closed():
            return
        if self._thread.is_alive():
            async def cancel_rest() -> None:
                rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for t in rest:
                    t.cancel()
                await asyncio.gather(*rest, return_exceptions=True)
                await self.loop.shutdown_asyncgens()

            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(cancel_rest(), self.loop).result(10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()
