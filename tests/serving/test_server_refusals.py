"""Refusals that are seen and counted: bodies that do not parse, requests over the size,
stop and id limits, and streams past the open-stream limit; health checks and unary
calls keep being answered while the streams are full."""

from __future__ import annotations

import logging
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.entrypoints.grpc.server import GenerationServer
from serving.entrypoints.validation import RequestLimits
from serving.proto.hybrid_jax.v1 import generation_pb2 as pb
from serving.proto.hybrid_jax.v1 import generation_pb2_grpc as pb_grpc
from serving.sample.sampling_params import SamplingParams
from tests.serving.server_helpers import collect, metric_samples, rejected, request_for, rpc_code, wait_for

LIMITS = RequestLimits(max_request_bytes=16384, max_stop_strings=4, max_stop_chars=32,
                       max_stop_token_ids=8, max_request_id_chars=40)
GOOD = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)


@pytest.fixture(scope="module")
def served(server_engine):
    server = GenerationServer(server_engine, model_name="native-tiny", port=0, metrics_port=0,
                              max_streams=2, limits=LIMITS).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    raw = {m: channel.unary_unary(f"/hybrid_jax.v1.Generation/{m}", request_serializer=lambda b: b,
                                  response_deserializer=lambda b: b) for m in ("Tokenize", "GetModelInfo")}
    raw["Generate"] = channel.unary_stream("/hybrid_jax.v1.Generation/Generate",
                                           request_serializer=lambda b: b,
                                           response_deserializer=pb.GenerateResponse.FromString)
    try:
        yield server, pb_grpc.GenerationStub(channel), raw, channel
    finally:
        channel.close()
        server.shutdown(grace_s=0)


def _call(raw, method: str, body: bytes):
    if method == "Generate":
        return lambda: list(raw[method](body, timeout=30))
    return lambda: raw[method](body, timeout=30)


BAD_UTF8 = pb.GenerateRequest(text="ab").SerializeToString().replace(b"ab", b"\xff\xfe")
UNPARSED = {"garbage": ("Generate", b"\x0a\xff\xff\xff"), "bad utf-8": ("Generate", BAD_UTF8),
            "truncated": ("Generate", request_for("Hello", GOOD).SerializeToString()[:-3]),
            "tokenize utf-8": ("Tokenize", b"\x0a\x02\xc3\x28"),
            "model info garbage": ("GetModelInfo", b"\xff\xff\xff\xff")}


@pytest.mark.parametrize("case", list(UNPARSED))
def test_a_body_that_does_not_parse_is_invalid_argument_logged_and_counted(served, case, caplog):
    server, stub, raw, _ = served
    method, body = UNPARSED[case]
    before = rejected(metric_samples(server.metrics_port), "INVALID_ARGUMENT", "unparsed")
    with caplog.at_level(logging.INFO, logger="serving.requests"):
        code, details = rpc_code(_call(raw, method, body))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a valid" in details
    assert rejected(metric_samples(server.metrics_port), "INVALID_ARGUMENT", "unparsed") == before + 1
    events = [r.fields for r in caplog.records if getattr(r, "fields", {}).get("event") == "request.rejected"]
    assert events and events[-1]["reason"] == "unparsed" and events[-1]["code"] == "INVALID_ARGUMENT"
    assert collect(stub, request_for("Hello", GOOD)).completion_tokens == 4


OVER = {
    "stop count": (request_for("Hi", SamplingParams(max_tokens=2, stop=["a", "b", "c", "d", "e"])),
                   "params.stop"),
    "10,000 stops": (pb.GenerateRequest(text="Hi", params=pb.SamplingParameters(stop=["x"] * 10_000)),
                     "request"),  # over the byte limit before anything else
    "stop length": (request_for("Hi", SamplingParams(max_tokens=2, stop=["ok", "y" * 33])), "params.stop[1]"),
    "stop ids": (request_for("Hi", SamplingParams(max_tokens=2, stop_token_ids=list(range(1, 10)))),
                 "params.stop_token_ids"),
    "request id": (request_for("Hi", GOOD, request_id="r" * 41), "request_id"),
    "bytes": (pb.GenerateRequest(text="x" * 20_000), "request"),
}


@pytest.mark.parametrize("case", list(OVER))
def test_requests_over_a_limit_are_refused_naming_it(served, case):
    server, stub, _, _ = served
    request, field = OVER[case]
    before = metric_samples(server.metrics_port)
    code, details = rpc_code(lambda: list(stub.Generate(request, timeout=30)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(f"{field}:")
    reason = "unparsed" if field == "request" else "invalid"
    grown = rejected(metric_samples(server.metrics_port), "INVALID_ARGUMENT", reason) - \
        rejected(before, "INVALID_ARGUMENT", reason)
    assert grown == 1


def test_limits_allow_what_they_name(served):
    server, stub, _, _ = served
    ok = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, stop=["q" * 32] * 4,
                        stop_token_ids=list(range(200, 208)))
    assert collect(stub, request_for("Hi", ok, request_id="r" * 40)).completion_tokens == 3


def test_far_oversized_body_is_refused_by_grpc_not_internal(served):
    server, _, raw, _ = served
    code, _ = rpc_code(_call(raw, "Generate", pb.GenerateRequest(text="x" * 40_000).SerializeToString()))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_full_streams_refuse_one_more_counted_while_health_and_unary_answer(served):
    server, stub, _, channel = served
    slow = lambda deltas, dt: time.sleep(0.05)  # the long streams outlive the checks (>= 5 s)
    server.core.on_step.append(slow)
    calls = []
    try:
        calls = [stub.Generate(request_for(f"long {i}", LONG), timeout=60) for i in range(2)]
        for c in calls:
            next(c)  # both streams open and generating
        before = rejected(metric_samples(server.metrics_port), "RESOURCE_EXHAUSTED", "too_many_streams")
        code, details = rpc_code(lambda: list(stub.Generate(request_for("one more", GOOD), timeout=30)))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "2 streams open" in details
        after = rejected(metric_samples(server.metrics_port), "RESOURCE_EXHAUSTED", "too_many_streams")
        assert after == before + 1
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert stub.Tokenize(pb.TokenizeRequest(text="hi"), timeout=5).token_ids
        assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5).model == "native-tiny"
        assert all(c.is_active() for c in calls)
    finally:
        for c in calls:
            c.cancel()
        server.core.on_step.remove(slow)
    wait_for(lambda: server.core.num_live() == 0, what="the cancelled streams to close")
    assert collect(stub, request_for("after", GOOD)).completion_tokens == 4
