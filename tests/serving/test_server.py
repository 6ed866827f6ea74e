"""The gRPC server on a real localhost port: parity with LLM.generate, concurrency,
cancel and deadline free pages and slots at once, the bounded queue, health,
reflection and metrics."""

from __future__ import annotations

import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from serving.entrypoints.grpc.server import GenerationServer
from serving.entrypoints.llm import LLM
from serving.proto.hybrid_jax.v1 import generation_pb2_grpc as pb_grpc
from serving.sample.sampling_params import SamplingParams
from tests.serving.server_helpers import collect, request_for, rpc_code, wait_for

N_CLIENTS = 64
LONG = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)


def _workload() -> list[tuple[str | list[int], SamplingParams]]:
    """64 requests of different lengths: text and token prompts, greedy and seeded (some penalized)."""
    out = []
    for i in range(N_CLIENTS):
        prompt = f"Request {i} says" if i % 2 else [1, 3 + i % 50, 7 + i, 40]
        params = (SamplingParams(temperature=0.0, max_tokens=1 + i % 23, ignore_eos=i % 3 == 0)
                  if i % 4 < 2 else
                  SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=1000 + i, max_tokens=2 + i % 17,
                                 repetition_penalty=1.0 + 0.1 * (i % 3), presence_penalty=0.25 * (i % 2)))
        out.append((prompt, params))
    return out


@pytest.fixture(scope="module")
def served(server_engine):
    """(server, stub, expected outputs of _workload() from LLM.generate on the same engine)."""
    llm = LLM.from_engine(server_engine)
    work = _workload()
    expected = []
    for prompt, params in work:  # one at a time: text and token prompts cannot mix in one call
        kwargs = {"prompt_token_ids": [prompt]} if isinstance(prompt, list) else {"prompts": [prompt]}
        expected.append(llm.generate(sampling_params=params, **kwargs)[0])
    server = GenerationServer(server_engine, model_name="native-tiny", host="127.0.0.1", port=0,
                              metrics_port=0, max_waiting=128).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield server, pb_grpc.GenerationStub(channel), work, expected
    finally:
        channel.close()
        server.shutdown(grace_s=0)


def _assert_same(got, want) -> None:
    assert got.token_ids == want.token_ids
    assert got.text == want.text
    assert got.finish_reason == want.finish_reason
    assert got.completion_tokens == len(want.token_ids)
    assert got.prompt_tokens == len(want.prompt_token_ids)


def _idle(server: GenerationServer) -> bool:
    s = server.core.stats()
    return s["slots_in_use"] == 0 and sum(s["pages_in_use"].values()) == 0 and not server.core.num_live()


@pytest.fixture
def slow_steps(served):
    """Make every engine step take >= 20 ms: a long request then needs > 2 s, far past our checks."""
    server = served[0]
    sleeper = lambda deltas, seconds: time.sleep(0.02)
    server.core.on_step.append(sleeper)
    yield
    server.core.on_step.remove(sleeper)


@pytest.mark.parametrize("which", ["greedy", "seeded"])
def test_stream_equals_llm_generate(served, which):
    server, stub, work, expected = served
    picks = [i for i, (_, p) in enumerate(work) if p.is_greedy == (which == "greedy")][:6]
    for i in picks:
        got = collect(stub, request_for(*work[i]))
        _assert_same(got, expected[i])
        assert got.messages >= 1


def test_64_concurrent_streams_all_finish_correctly(served):
    server, stub, work, expected = served
    with ThreadPoolExecutor(N_CLIENTS) as pool:
        futures = [pool.submit(collect, stub, request_for(*w), 120) for w in work]
        wait_for(lambda: server.core.num_live() >= N_CLIENTS // 2 or all(f.done() for f in futures),
                 what="streams open")
        # The gRPC front holds no thread per stream: its event loop plus the engine
        # client's small pool (a sync server held one pool thread per open stream).
        front_threads = [t.name for t in threading.enumerate() if t.name.startswith("grpc")]
        results = [f.result(timeout=180) for f in futures]
    assert len(front_threads) <= 5, front_threads
    for got, want in zip(results, expected, strict=True):
        _assert_same(got, want)
    wait_for(lambda: _idle(server), what="pool usage back to zero")


def _cancel_or_expire(served, how: str) -> None:
    server, stub, work, expected = served
    others = [5, 9, 12]
    with ThreadPoolExecutor(len(others)) as pool:
        futures = [pool.submit(collect, stub, request_for(*work[i]), 120) for i in others]
        rid = f"long-{how}"
        timeout = 0.5 if how == "deadline" else 60
        call = stub.Generate(request_for("A long one", LONG, request_id=rid), timeout=timeout)
        got = [next(call) for _ in range(3)]  # mid-way: prefill done, decoding
        assert all(not m.finish_reason for m in got)
        assert server.core.engine.scheduler.get(rid) is not None
        if how == "cancel":
            call.cancel()
            code, _ = rpc_code(lambda: list(call))
            assert code == grpc.StatusCode.CANCELLED
        else:
            code, _ = rpc_code(lambda: list(call))
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED
        # Freed at once: gone from the scheduler well before it could have finished.
        wait_for(lambda: server.core.engine.scheduler.get(rid) is None, timeout=1.0,
                 what=f"the {how} request to leave the scheduler")
        for i, f in zip(others, futures, strict=True):
            _assert_same(f.result(timeout=120), expected[i])
    wait_for(lambda: _idle(server), what="pages and slots back to baseline")


@pytest.mark.usefixtures("slow_steps")
def test_client_cancel_frees_pages_and_slot_and_others_continue(served):
    _cancel_or_expire(served, "cancel")


@pytest.mark.usefixtures("slow_steps")
def test_expired_deadline_frees_pages_and_slot_and_others_continue(served):
    _cancel_or_expire(served, "deadline")


@pytest.mark.usefixtures("slow_steps")
def test_tiny_waiting_queue_rejects_the_burst_excess(served):
    server, stub, work, expected = served
    burst = [i for i, (_, p) in enumerate(work) if p.max_tokens >= 10][:16]
    barrier = threading.Barrier(len(burst))

    def one(i: int):
        barrier.wait(timeout=30)
        try:
            return collect(stub, request_for(*work[i]), 120)
        except grpc.RpcError as err:
            return err.code()

    server.core.max_waiting = 2
    try:
        with ThreadPoolExecutor(len(burst)) as pool:
            results = list(pool.map(one, burst, timeout=180))
    finally:
        server.core.max_waiting = 128
    rejected = [r for r in results if isinstance(r, grpc.StatusCode)]
    assert set(rejected) == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert 2 <= len(burst) - len(rejected) < len(burst)
    for i, r in zip(burst, results, strict=True):
        if not isinstance(r, grpc.StatusCode):
            _assert_same(r, expected[i])  # accepted requests are served in full
    _assert_same(collect(stub, request_for(*work[1])), expected[1])  # and the server serves on


def test_health_reports_serving(served):
    server = served[0]
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", "hybrid_jax.v1.Generation"):
            resp = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_generation_service(served):
    server = served[0]
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        req = reflection_pb2.ServerReflectionRequest(list_services="")
        resp = next(stub.ServerReflectionInfo(iter([req]), timeout=10))
        names = {s.name for s in resp.list_services_response.service}
        assert {"hybrid_jax.v1.Generation", "grpc.health.v1.Health"} <= names
        req = reflection_pb2.ServerReflectionRequest(file_containing_symbol="hybrid_jax.v1.Generation")
        resp = next(stub.ServerReflectionInfo(iter([req]), timeout=10))
        assert resp.file_descriptor_response.file_descriptor_proto


def _scrape(server: GenerationServer) -> dict[tuple[str, tuple], float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read()
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_expose_the_series_with_plausible_values(served):
    server, stub, work, expected = served
    before = _scrape(server)
    for i in (0, 1, 4):
        collect(stub, request_for(*work[i]))
    m = _scrape(server)
    grown = lambda key: m[key] - before.get(key, 0.0)
    n_tokens = sum(len(expected[i].token_ids) for i in (0, 1, 4))
    assert grown(("hybrid_jax_generation_tokens_total", ())) == n_tokens
    assert grown(("hybrid_jax_prompt_tokens_total", ())) == sum(len(expected[i].prompt_token_ids)
                                                                 for i in (0, 1, 4))
    finished = sum(grown(("hybrid_jax_requests_total", (("finish_reason", r),)))
                   for r in ("stop", "length", "abort"))
    assert finished == 3
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "engine_step_seconds"):
        assert grown((f"hybrid_jax_{h}_count", ())) >= 3
        assert 0 < m[(f"hybrid_jax_{h}_sum", ())] < 600
    assert grown(("hybrid_jax_time_per_output_token_seconds_count", ())) >= 2
    assert m[("hybrid_jax_slots_total", ())] == 4
    assert m[("hybrid_jax_pages_total", (("group", "w64"),))] > 0
    for g in ("num_requests_running", "num_requests_waiting", "slots_in_use"):
        assert m[(f"hybrid_jax_{g}", ())] == 0  # idle after the run
    assert m[("hybrid_jax_pages_in_use", (("group", "w64"),))] == 0
