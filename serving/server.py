"""The serving process: gRPC server + engine core + health + reflection + metrics, and shutdown.

    server = GenerationServer(engine, model_name="native-tiny", port=0, metrics_port=0).start()
    ...                       # server.port / server.metrics_port are the bound ports
    server.shutdown(grace_s=30)

`GenerationServer` wires the parts together: an `EngineCore` (the engine loop
thread), a sync `grpc.server` whose thread pool holds one thread per open stream,
the `Generation` servicer, the standard `grpc.health.v1` service, server
reflection, and the Prometheus endpoint. `run_until_signal` is what
`hybrid-jax serve` runs: it blocks until SIGTERM or SIGINT, then shuts down
gracefully and returns (the process exits 0).

Shutdown: health turns NOT_SERVING and new Generate calls get UNAVAILABLE; requests
in flight run for up to `grace_s`; what is left is aborted (its stream ends with
UNAVAILABLE); then the transport stops. This module knows nothing of request
validation or how deltas become messages (see `serving.grpc_service`).
"""

from __future__ import annotations

import signal
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from serving.engine import LLMEngine
from serving.engine_core import EngineCore
from serving.grpc_service import GenerationServicer
from serving.metrics import ServerMetrics
from serving.proto.hybrid_jax.v1 import generation_pb2 as pb
from serving.proto.hybrid_jax.v1 import generation_pb2_grpc as pb_grpc
from serving.request_log import log_event

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "hybrid_jax.v1.Generation"
SPARE_WORKERS = 16  # threads beyond the admitted streams: health, unary calls, rejections


class GenerationServer:
    """One engine served over gRPC on `host:port` (port 0 picks a free one).

    max_waiting bounds the engine's waiting queue (RESOURCE_EXHAUSTED beyond it).
    The gRPC pool gets one thread per stream that can be admitted (running +
    waiting) plus spares; calls beyond that are refused by gRPC itself with
    RESOURCE_EXHAUSTED rather than queued invisibly.
    """

    def __init__(self, engine: LLMEngine, *, model_name: str, host: str = "[::]", port: int = 0,
                 metrics_port: int | None = None, max_waiting: int = 128,
                 max_workers: int | None = None):
        self.core = EngineCore(engine, max_waiting=max_waiting)
        self.metrics = ServerMetrics(self.core.stats)
        self.core.on_step.append(self.metrics.on_step)
        workers = max_workers or engine.plan.scheduler.max_num_seqs + max_waiting + SPARE_WORKERS
        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpc"),
                                 maximum_concurrent_rpcs=workers)
        pb_grpc.add_GenerationServicer_to_server(
            GenerationServicer(self.core, self.metrics, model_name=model_name), self._grpc)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME),
                                            self._grpc)
        self.port = self._grpc.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"could not bind {host}:{port}")
        self._metrics_port_arg = metrics_port
        self.metrics_port: int | None = None
        self.model_name = model_name
        self._stopped = threading.Event()

    def start(self) -> GenerationServer:
        """Start the engine loop, the metrics endpoint and the gRPC server; report SERVING."""
        self.core.start()
        if self._metrics_port_arg is not None:
            self.metrics_port = self.metrics.start_http(self._metrics_port_arg)
        self._grpc.start()
        self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log_event("server.started", model=self.model_name, port=self.port, metrics_port=self.metrics_port)
        return self

    def shutdown(self, grace_s: float = 30.0) -> None:
        """Stop accepting, let in-flight requests finish for `grace_s`, abort the rest, stop.

        Idempotent. Aborted streams end with UNAVAILABLE; the transport then gets a few
        seconds to deliver those statuses before it closes.
        """
        if self._stopped.is_set():
            return
        self._stopped.set()
        live = self.core.num_live()
        log_event("server.stopping", in_flight=live, grace_s=grace_s)
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        t0 = time.monotonic()
        self.core.shutdown(grace_s)  # stop accepting, wait up to grace_s, abort the rest
        self._grpc.stop(grace=5.0).wait()
        self.metrics.stop_http()
        log_event("server.stopped", in_flight_at_signal=live, seconds=round(time.monotonic() - t0, 3))

    def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)

    def run_until_signal(self, grace_s: float = 30.0) -> None:
        """Block until SIGTERM or SIGINT (main thread only), then shut down gracefully."""
        got = threading.Event()
        previous = {s: signal.signal(s, lambda signum, frame: got.set())
                    for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            while not got.wait(timeout=1.0):
                pass
            log_event("server.signal", grace_s=grace_s)
            self.shutdown(grace_s)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
