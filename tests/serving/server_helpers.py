"""Helpers of the gRPC server tests: build requests, collect streams, poll with a timeout."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from serving.entrypoints.grpc.client import make_request
from serving.proto.hybrid_jax.v1 import generation_pb2 as pb
from serving.proto.hybrid_jax.v1 import generation_pb2_grpc as pb_grpc
from serving.sample.sampling_params import SamplingParams

REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
           pb.FINISH_REASON_ABORT: "abort"}


@dataclass
class Collected:
    """A finished stream, flattened."""

    token_ids: list[int]
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    messages: int


def request_for(prompt: str | list[int], params: SamplingParams, request_id: str = "") -> pb.GenerateRequest:
    """The wire request equal to (prompt, params) given to LLM.generate."""
    return make_request(prompt, request_id=request_id, temperature=params.temperature,
                        top_k=params.top_k, top_p=params.top_p, min_p=params.min_p, seed=params.seed,
                        repetition_penalty=params.repetition_penalty,
                        presence_penalty=params.presence_penalty,
                        frequency_penalty=params.frequency_penalty,
                        max_tokens=params.max_tokens, min_tokens=params.min_tokens,
                        stop=list(params.stop), stop_token_ids=list(params.stop_token_ids),
                        ignore_eos=params.ignore_eos, logprobs=params.logprobs,
                        logit_bias=dict(params.logit_bias) or None)


def collect(stub: pb_grpc.GenerationStub, request: pb.GenerateRequest, timeout: float = 60) -> Collected:
    """Run one Generate to the end (raises grpc.RpcError on a status)."""
    msgs = list(stub.Generate(request, timeout=timeout))
    last = msgs[-1]
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in msgs[:-1])
    return Collected([t for m in msgs for t in m.token_ids], "".join(m.text for m in msgs),
                     REASONS.get(last.finish_reason), last.usage.prompt_tokens,
                     last.usage.completion_tokens, len(msgs))


def wait_for(condition: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll `condition` every 10 ms; AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


def rpc_code(fn: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    """Call `fn`, which must fail with a gRPC status; return (code, details)."""
    try:
        fn()
    except grpc.RpcError as err:
        return err.code(), err.details()
    raise AssertionError("the call succeeded; a gRPC error was expected")


def metric_samples(metrics_port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of the server's /metrics, keyed by (name, sorted label items)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def rejected(samples: dict[tuple[str, tuple], float], code: str, reason: str) -> float:
    """hybrid_jax_requests_rejected_total{code, reason} (0 when absent)."""
    return samples.get(("hybrid_jax_requests_rejected_total", (("code", code), ("reason", reason))), 0.0)


def listening(port: int) -> list[str]:
    """Addresses with a TCP socket listening on `port` on this machine (Linux /proc/net)."""
    import ipaddress
    from pathlib import Path

    out = []
    for name, width in (("tcp", 4), ("tcp6", 16)):
        table = Path("/proc/net") / name
        for line in table.read_text().splitlines()[1:] if table.exists() else []:
            local, state = line.split()[1], line.split()[3]
            addr, hex_port = local.split(":")
            if state != "0A" or int(hex_port, 16) != port:  # 0A = LISTEN
                continue
            raw = bytes.fromhex(addr)  # little-endian 32-bit words
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
            ip = ipaddress.ip_address(raw)
            out.append(str(ip.ipv4_mapped or ip) if ip.version == 6 else str(ip))
    return out


def poisoned(engine, request_id: str | None, *, lose_state: bool = False):
    """Make every step that holds `request_id` (None: every step) raise; returns an undo."""
    dispatch, lost = engine.runner.dispatch, engine.runner.state_lost

    def faulty(arrays, *args, **kwargs):
        seq = engine.scheduler.get(request_id) if request_id else None
        if request_id is None or (seq is not None and seq.slot in arrays.slot_ids.tolist()):
            raise RuntimeError("injected fault")
        return dispatch(arrays, *args, **kwargs)

    engine.runner.dispatch = faulty
    if lose_state:
        engine.runner.state_lost = lambda: True

    def undo() -> None:
        engine.runner.dispatch, engine.runner.state_lost = dispatch, lost
    return undo
