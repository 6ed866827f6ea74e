"""Engine faults as gRPC clients and operators see them: a request the engine fails ends
with INTERNAL (counted as finish_reason="error", logged) while the others finish and
health stays SERVING; a fault the engine cannot recover from turns health NOT_SERVING
and makes `run_until_signal` return non-zero. The fault is injected by wrapping the
runner (a test hook, as in tests/serving/test_faults.py)."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.entrypoints.grpc.server import EXIT_ENGINE_FAILED, GenerationServer
from serving.entrypoints.llm import LLM
from serving.proto.hybrid_jax.v1 import generation_pb2_grpc as pb_grpc
from serving.sample.sampling_params import SamplingParams
from tests.serving.server_helpers import collect, metric_samples, poisoned, request_for, rpc_code, wait_for

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = ["First of all", "Second", "A third one", "Fourth"]


def _health(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status


@pytest.fixture(scope="module")
def expected(server_engine) -> dict[str, list[int]]:
    """Outputs without a fault (computed before any server's engine loop runs)."""
    llm = LLM.from_engine(server_engine)
    return {p: llm.generate([p], PARAMS)[0].token_ids for p in PROMPTS}


@pytest.fixture
def server(server_engine, expected):
    server = GenerationServer(server_engine, model_name="native-tiny", port=0, metrics_port=0).start()
    yield server
    server.shutdown(grace_s=0)


def test_a_failed_request_gets_internal_and_the_others_their_output(server, server_engine, expected,
                                                                       caplog):
    before = metric_samples(server.metrics_port)
    undo = poisoned(server_engine, "bad")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch, ThreadPoolExecutor(5) as pool, \
                caplog.at_level(logging.INFO, logger="serving.requests"):
            stub = pb_grpc.GenerationStub(ch)
            good = [pool.submit(collect, stub, request_for(p, PARAMS), 120) for p in PROMPTS]
            code, details = rpc_code(lambda: list(stub.Generate(
                request_for("Poison", PARAMS, request_id="bad"), timeout=120)))
            got = {p: f.result(timeout=120).token_ids for p, f in zip(PROMPTS, good, strict=True)}
    finally:
        undo()
    assert code == grpc.StatusCode.INTERNAL and "request bad failed in the engine" in details
    assert got == expected
    after = metric_samples(server.metrics_port)
    key = ("hybrid_jax_requests_total", (("finish_reason", "error"),))
    assert after[key] - before.get(key, 0) == 1
    events = [r.fields for r in caplog.records if hasattr(r, "fields")]
    assert [e["request_id"] for e in events if e["event"] == "request.failed"] == ["bad"]
    finished = [e for e in events if e["event"] == "request.finished" and e["request_id"] == "bad"]
    assert [e["finish_reason"] for e in finished] == ["error"]
    assert _health(server.port) == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        again = collect(pb_grpc.GenerationStub(ch), request_for("Poison", PARAMS, request_id="bad"))
    assert again.completion_tokens == 8  # the fault is gone: the same request now succeeds


def test_an_unrecoverable_fault_turns_health_off_and_exits_non_zero(server, server_engine):
    undo = poisoned(server_engine, None, lose_state=True)
    seen: dict[str, object] = {}

    def client() -> None:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            stub = pb_grpc.GenerationStub(ch)
            seen["stream"] = rpc_code(lambda: list(stub.Generate(request_for("Doomed", PARAMS), timeout=60)))
            wait_for(lambda: _health(server.port) == health_pb2.HealthCheckResponse.NOT_SERVING,
                     what="health NOT_SERVING")
            seen["health"] = "NOT_SERVING"
            seen["late"] = rpc_code(lambda: list(stub.Generate(request_for("Late", PARAMS), timeout=10)))

    thread = threading.Thread(target=client)
    try:
        thread.start()
        code = server.run_until_signal(grace_s=30)  # returns when the engine reports the fault
        thread.join(timeout=30)
    finally:
        undo()
    assert code == EXIT_ENGINE_FAILED != 0
    assert not server.core.healthy and server.fatal_error is not None
    assert seen["stream"][0] == grpc.StatusCode.UNAVAILABLE and "retry" in seen["stream"][1]
    assert seen["health"] == "NOT_SERVING"
    assert seen["late"][0] == grpc.StatusCode.UNAVAILABLE
    stats = server_engine.stats()  # the shared engine is left clean for the next tests
    assert stats["slots_in_use"] == 0 and sum(stats["pages_in_use"].values()) == 0


def _fail_one(port: int, prompt: str) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        code, _ = rpc_code(lambda: list(pb_grpc.GenerationStub(ch).Generate(
            request_for(prompt, PARAMS), timeout=60)))
    assert code == grpc.StatusCode.INTERNAL


def _finished_total(server) -> float:
    return sum(s.value for fam in server.metrics.registry.collect() if fam.name == "hybrid_jax_requests"
               for s in fam.samples if s.name.endswith("_total"))


def test_consecutive_failed_requests_turn_health_off_until_one_succeeds(server_engine, expected):
    """NOT_SERVING after `unhealthy_after` requests in a row failed in the engine; SERVING
    again when a client's request succeeds, or the core's own probe while idle."""
    server = GenerationServer(server_engine, model_name="native-tiny", port=0,
                              unhealthy_after=2, probe_interval_s=3600).start()
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    try:
        for recover_by_probe in (False, True):
            undo = poisoned(server_engine, None)  # every step fails (state kept: recoverable)
            try:
                _fail_one(server.port, "First of all")
                assert _health(server.port) == serving  # one failure is not a pattern
                _fail_one(server.port, "Second")
                assert _health(server.port) == not_serving
            finally:
                undo()
            if recover_by_probe:
                before = _finished_total(server)
                server.core.probe_interval_s = 0.0  # the idle core probes itself
                wait_for(lambda: _health(server.port) == serving, what="health SERVING after a probe")
                assert _finished_total(server) == before  # a probe is no one's request
            else:
                with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
                    got = collect(pb_grpc.GenerationStub(ch), request_for(PROMPTS[0], PARAMS))
                assert got.token_ids == expected[PROMPTS[0]]
                assert _health(server.port) == serving
        assert server.core.healthy and not server.core.degraded
    finally:
        server.shutdown(grace_s=0)


def test_a_failing_self_test_fails_the_start(server_engine):
    from serving.engine.engine_core import SelfTestFailed

    undo = poisoned(server_engine, None)
    try:
        server = GenerationServer(server_engine, model_name="native-tiny", port=0)
        with pytest.raises(SelfTestFailed, match="self-test request failed: .*injected fault"):
            server.start()
    finally:
        undo()
    assert not server.core._thread.is_alive()  # nothing started: the caller exits
    stats = server_engine.stats()
    assert stats["slots_in_use"] == 0 and stats["num_waiting"] == 0 and stats["num_running"] == 0


def test_serve_exits_non_zero_with_one_line_when_the_self_test_fails(server_engine, monkeypatch, capsys):
    """`hybrid-jax serve` over an engine whose steps fail: one error line, exit 1, never SERVING."""
    import hybrid_jax.loading
    import serving.engine.llm_engine
    from serving.entrypoints.cli import main

    monkeypatch.setattr(hybrid_jax.loading, "load_model", lambda *a, **k: None)
    monkeypatch.setattr(serving.engine.llm_engine, "LLMEngine", lambda *a, **k: server_engine)
    monkeypatch.setattr(serving.engine.llm_engine, "freeze_heap", lambda: None)  # a test process
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level  # `serve` sets up the process's logging
    undo = poisoned(server_engine, None)
    try:
        code = main(["serve", "--model", "native-tiny", "--port", "0", "--metrics-port", "-1",
                     "--log-level", "error"])
    finally:
        undo()
        root.handlers[:], root.level = handlers, level
    err = capsys.readouterr().err
    assert code == EXIT_ENGINE_FAILED != 0
    lines = [line for line in err.splitlines() if line.startswith("hybrid-jax serve: error:")]
    assert lines == [err.splitlines()[-1]] and "self-test request failed" in lines[0], err
