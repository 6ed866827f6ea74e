"""Graceful shutdown in process: in-flight streams finish within the grace period, new
requests get UNAVAILABLE, and what outlives the grace period ends with UNAVAILABLE."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.entrypoints.grpc.server import GenerationServer
from serving.proto.hybrid_jax.v1 import generation_pb2_grpc as pb_grpc
from serving.sample.sampling_params import SamplingParams
from tests.serving.server_helpers import collect, request_for, rpc_code, wait_for


def _server(engine) -> tuple[GenerationServer, grpc.Channel, pb_grpc.GenerationStub]:
    server = GenerationServer(engine, model_name="native-tiny", host="127.0.0.1", port=0).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    return server, channel, pb_grpc.GenerationStub(channel)


def _slow(server: GenerationServer, seconds: float) -> None:
    server.core.on_step.append(lambda deltas, dt: time.sleep(seconds))


def test_in_flight_requests_finish_within_the_grace_period(server_engine):
    server, channel, stub = _server(server_engine)
    _slow(server, 0.005)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    try:
        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(collect, stub, request_for(f"p{i}", params), 60) for i in range(6)]
            wait_for(lambda: server.core.num_live() == 6, what="6 live requests")
            stopper = threading.Thread(target=server.shutdown, kwargs={"grace_s": 60})
            stopper.start()
            health = health_pb2_grpc.HealthStub(channel)
            wait_for(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=10).status ==
                     health_pb2.HealthCheckResponse.NOT_SERVING, what="health NOT_SERVING")
            code, details = rpc_code(lambda: list(stub.Generate(request_for("late", params), timeout=10)))
            assert code == grpc.StatusCode.UNAVAILABLE and "shutting down" in details
            results = [f.result(timeout=60) for f in futures]
            stopper.join(timeout=60)
        assert [r.finish_reason for r in results] == ["length"] * 6
        assert all(r.completion_tokens == 20 for r in results)
    finally:
        channel.close()
        server.shutdown(grace_s=0)


def test_requests_past_the_grace_period_end_with_unavailable(server_engine):
    server, channel, stub = _server(server_engine)
    _slow(server, 0.01)
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    try:
        calls = [stub.Generate(request_for(f"p{i}", params), timeout=60) for i in range(3)]
        for call in calls:
            next(call)  # in flight
        t0 = time.monotonic()
        server.shutdown(grace_s=0.2)
        assert time.monotonic() - t0 < 20
        for call in calls:
            code, details = rpc_code(lambda c=call: list(c))
            assert code == grpc.StatusCode.UNAVAILABLE and "aborted" in details
        stats = server_engine.stats()
        assert stats["slots_in_use"] == 0 and sum(stats["pages_in_use"].values()) == 0
    finally:
        channel.close()
        server.shutdown(grace_s=0)
