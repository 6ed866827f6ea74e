"""The data-parallel checks, run in a child process that sees 4 CPU devices.

`tests/serving/test_data_parallel.py` starts this script with
XLA_FLAGS=--xla_force_host_platform_device_count=4 (the pytest process has already
initialised JAX with one device) and reads the JSON it prints: one entry per check,
True or what went wrong. The reference is one engine (data_parallel_size=1) on device 0,
whose code path is the one served before data parallelism existed.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time
import traceback

import jax

from serving.engine.data_parallel import DataParallelCore, build_engines
from serving.engine.engine_config import EngineConfig
from serving.engine.engine_core import EngineCore, EngineStopped, QueueFull, SelfTestFailed
from serving.engine.llm_engine import LLMEngine
from serving.sample.sampling_params import SamplingParams
from tests.serving.server_helpers import poisoned

CFG = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_chunk=16, max_model_len=128,
                   page_size=8, seq_buckets=(1, 4), token_buckets=(32,))
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
PROMPTS = [[1 + (7 * i + 3 * j) % 250 for j in range(n)] for i, n in enumerate((3, 21, 30, 9, 17, 5))]
RESULTS: dict[str, object] = {}


def check(name: str, ok: bool, detail: object = None) -> None:
    RESULTS[name] = True if ok else f"failed: {detail}"


def serve(core, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    """Submit every prompt at once, then collect each stream's tokens."""
    streams = [core.submit(params=params, prompt_token_ids=p) for p in prompts]
    return [[t for d in s for t in d.token_ids] for s in streams]


def devices_of(engine: LLMEngine) -> set[int]:
    return {d.id for x in jax.tree.leaves((engine.runner.params, engine.runner.caches)) for d in x.devices()}


def wait_for(cond, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def main() -> None:
    assert len(jax.local_devices()) == 4, jax.local_devices()
    # Every array stays on its replica's devices, in every thread: a device-to-device copy
    # (a model loaded on device 0 then moved, an op landing on the default device) raises.
    jax.config.update("jax_transfer_guard_device_to_device", "disallow_explicit")
    t0 = time.perf_counter()
    cfg = dataclasses.replace(CFG, data_parallel_size=2)
    engines = build_engines("native-tiny", cfg, show_progress=False)
    RESULTS["seconds build"] = round(time.perf_counter() - t0, 1)
    # The reference: replica 0 alone, the plain EngineCore (replica 0 is what a
    # data_parallel_size=1 engine is: device 0, the same configuration).
    ref_core = EngineCore(engines[0]).start()
    ref = serve(ref_core, PROMPTS)
    ref_core.shutdown()

    t0 = time.perf_counter()
    core = DataParallelCore(engines)
    core.self_test()
    core.start()
    got = serve(core, PROMPTS)
    RESULTS["seconds dp=2"] = round(time.perf_counter() - t0, 1)
    check("dp=2 greedy tokens == dp=1", got == ref, (got, ref))
    check("replica i on device i", [devices_of(e) for e in engines] == [{0}, {1}],
          [devices_of(e) for e in engines])
    stats = core.stats()
    per = [r["requests_submitted"] for r in stats["replicas"]]
    check("requests on both replicas", min(per) >= 2 and sum(per) == len(PROMPTS)
          and stats["requests_submitted"] == len(PROMPTS), per)
    check("stats sum the replicas", stats["slots_total"] == sum(r["slots_total"] for r in stats["replicas"])
          and stats["weight_bytes"] == stats["replicas"][0]["weight_bytes"]
          and stats["data_parallel_size"] == 2, stats)

    # Abort on replica 1: the second long request lands there (replica 0 holds the first).
    first = core.submit(params=LONG, prompt_token_ids=PROMPTS[0])
    second = core.submit(params=LONG, prompt_token_ids=PROMPTS[1])
    on = [[r.holds(s.request_id) for r in core.replicas] for s in (first, second)]
    aborted = core.abort(second.request_id)
    deltas = list(second)
    check("abort on replica 1", on == [[True, False], [False, True]] and aborted
          and deltas[-1].finish_reason == "abort" and core.replicas[1].num_live() == 0
          and core.replicas[0].num_live() == 1, (on, aborted, deltas[-1:]))
    rest = [t for d in first for t in d.token_ids]
    check("the other replica's request runs on", len(rest) == LONG.max_tokens, len(rest))
    check("abort of an unknown id is False", core.abort("no-such-request") is False)
    core.shutdown()

    queue_checks(engines)
    t0 = time.perf_counter()
    server_checks(engines, ref)
    health_checks(engines)
    RESULTS["seconds server and health"] = round(time.perf_counter() - t0, 1)


def main_tp() -> None:
    """dp=2 x tp=2 on 4 devices: replica 1 (devices 2, 3) serves what replica 0 alone serves."""
    assert len(jax.local_devices()) == 4, jax.local_devices()
    t0 = time.perf_counter()
    cfg = dataclasses.replace(CFG, tensor_parallel_size=2, data_parallel_size=2)
    engines = build_engines("native-tiny", cfg, show_progress=False)
    ref_core = EngineCore(engines[0]).start()  # a tensor_parallel_size=2 engine on devices 0, 1
    ref = serve(ref_core, PROMPTS)
    ref_core.shutdown()
    core = DataParallelCore(engines).start()
    got = serve(core, PROMPTS)
    per = [r["requests_submitted"] for r in core.stats()["replicas"]]
    core.shutdown()
    RESULTS["seconds dp=2 x tp=2"] = round(time.perf_counter() - t0, 1)
    check("dp=2 x tp=2 tokens == one tp=2 engine", got == ref and min(per) >= 2, (got, ref, per))
    check("dp=2 x tp=2 replicas on devices 0-1 and 2-3",
          [devices_of(e) for e in engines] == [{0, 1}, {2, 3}], [devices_of(e) for e in engines])


def queue_checks(engines: list[LLMEngine]) -> None:
    """A full replica passes a request on; QueueFull only when every replica is full. A
    request id live on one replica is refused on the other. (The loops are not started:
    every submitted request waits.)"""
    core = DataParallelCore(engines, max_waiting=1)
    a = core.submit(params=GREEDY, prompt_token_ids=PROMPTS[0], request_id="a")
    try:
        core.submit(params=GREEDY, prompt_token_ids=PROMPTS[1], request_id="a")
        duplicate = "accepted"
    except ValueError as err:
        duplicate = str(err)
    b = core.submit(params=GREEDY, prompt_token_ids=PROMPTS[1])
    try:
        core.submit(params=GREEDY, prompt_token_ids=PROMPTS[2])
        full = "accepted"
    except QueueFull as err:
        full = str(err)
    where = [[r.holds(s.request_id) for r in core.replicas] for s in (a, b)]
    core.shutdown()
    check("queue full on every replica, duplicate id refused",
          where == [[True, False], [False, True]] and "every replica's waiting queue is full" in full
          and "request_id='a' is already in use" in duplicate, (where, full, duplicate))


def health_checks(engines: list[LLMEngine]) -> None:
    """Degraded while any replica is; a fatal fault in one replica is fatal for the server;
    a replica's failed self-test fails the start, naming it."""
    undo = poisoned(engines[1], None)
    try:
        DataParallelCore(engines).self_test()
        self_test = "passed"
    except SelfTestFailed as err:
        self_test = str(err)
    finally:
        undo()
    check("a replica's failed self-test fails the start",
          self_test.startswith("data-parallel replica 1: start-up self-test request failed"), self_test)
    core = DataParallelCore(engines, unhealthy_after=1, probe_interval_s=3600)
    heard: list[bool] = []
    fatal: list[BaseException] = []
    core.on_health.append(heard.append)
    core.on_fatal.append(fatal.append)
    core.start()
    busy = core.submit(params=LONG, prompt_token_ids=PROMPTS[0])  # replica 0
    undo = poisoned(engines[1], None)
    failed = list(core.submit(params=GREEDY, prompt_token_ids=PROMPTS[1]))  # replica 1
    undo()
    degraded = (failed[-1].finish_reason, core.degraded, core.replicas[0].degraded, list(heard))
    recovered = serve(core, [PROMPTS[2]])  # replica 1 again (replica 0 still busy): succeeds
    check("degraded while one replica is, serving again after", degraded == ("error", True, False, [False])
          and heard == [False, True] and not core.degraded and len(recovered[0]) == GREEDY.max_tokens,
          (degraded, heard, recovered))
    undo = poisoned(engines[1], None, lose_state=True)
    try:
        doomed = core.submit(params=GREEDY, prompt_token_ids=PROMPTS[3])  # replica 1: it dies
        try:
            list(doomed)
            ended = "no error"
        except EngineStopped:
            ended = "EngineStopped"
        wait_for(lambda: bool(fatal))
        try:
            core.submit(params=GREEDY, prompt_token_ids=PROMPTS[4])
            refused = False
        except EngineStopped:
            refused = True
        check("a replica's fatal fault is the server's", ended == "EngineStopped" and len(fatal) == 1
              and not core.healthy and core.fatal_error is fatal[0] and refused
              and core.replicas[0].healthy, (ended, fatal, core.healthy, refused))
    finally:
        undo()
        core.shutdown()
    check("the busy request was aborted at shutdown", list(busy)[-1].finish_reason == "abort")


def server_checks(engines: list[LLMEngine], ref: list[list[int]]) -> None:
    """GenerationServer over two engines: SERVING, the reference's tokens over gRPC, stats."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from serving.entrypoints.grpc.server import GenerationServer
    from serving.proto.hybrid_jax.v1 import generation_pb2_grpc as pb_grpc
    from tests.serving.server_helpers import collect, request_for

    server = GenerationServer(engines, model_name="native-tiny", port=0).start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
            stub = pb_grpc.GenerationStub(ch)
            got = [None] * len(PROMPTS)

            def one(i: int) -> None:
                got[i] = collect(stub, request_for(PROMPTS[i], GREEDY)).token_ids

            threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
        per = [r["requests_submitted"] for r in server.core.stats()["replicas"]]
        check("server over 2 replicas: SERVING, reference tokens, both used",
              status == health_pb2.HealthCheckResponse.SERVING and got == ref and min(per) >= 1
              and isinstance(server.core, DataParallelCore), (status, got, per))
    finally:
        server.shutdown(grace_s=0)


if __name__ == "__main__":
    try:
        main_tp() if sys.argv[1:] == ["tp"] else main()
    except Exception:
        RESULTS["child crashed"] = traceback.format_exc()
    print("RESULTS " + json.dumps(RESULTS), flush=True)
    sys.exit(0)
