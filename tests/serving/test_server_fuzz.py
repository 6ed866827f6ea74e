"""Fuzz a live server: a few hundred random and mutated requests (random bytes, random and
extreme field values, unknown fields, flipped bytes of good requests), bounded in count
and time. Every call ends with OK or a status the client can act on, never INTERNAL
or UNKNOWN, and afterwards a normal request gives its reference output and the pools
are back to their baseline."""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from serving.entrypoints.grpc.server import GenerationServer
from serving.entrypoints.llm import LLM
from serving.proto.hybrid_jax.v1 import generation_pb2 as pb
from serving.sample.sampling_params import SamplingParams
from tests.serving.server_helpers import request_for, wait_for

N_CALLS = 300
BUDGET_S = 90.0  # no call is started after this; each has its own deadline too
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS,
           grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION}
INTS = [0, 1, -1, 2, 7, 16, 127, 128, 255, 256, 1000, 2**31 - 1, -(2**31)]
FLOATS = [0.0, -0.0, 1e-9, 0.5, 1.0, 1.5, 2.0, -2.0, -1.0, 100.0, 1e308, -1e308, math.inf, -math.inf,
          math.nan]
GOOD = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


def _text(rng: np.random.Generator) -> str:
    alphabet = ["a", "Z", " ", "\n", "\x00", "é", "中", "🙂", "\u200b", "<s>", "</s>", "\\", "%s"]
    return "".join(rng.choice(alphabet) for _ in range(int(rng.integers(0, 40))))


SANE = {"temperature": [0.0, 0.7, 1.0], "top_k": [-1, 0, 1, 5, 50], "top_p": [0.5, 0.9, 1.0],
        "min_p": [0.0, 0.1], "repetition_penalty": [1.0, 1.2], "presence_penalty": [-1.0, 0.0, 0.5],
        "frequency_penalty": [0.0, 0.5], "seed": [0, 5, -1, 2**63 - 1, -(2**63), 2**32],
        "max_tokens": [1, 3, 8, 20], "min_tokens": [0, 1, 2], "ignore_eos": [True, False],
        "logprobs": [0, 1, 5]}


def _wild(rng: np.random.Generator, field) -> object:
    if field.type == field.TYPE_DOUBLE:
        return float(rng.choice(FLOATS))
    if field.type == field.TYPE_BOOL:
        return bool(rng.random() < 0.5)
    if field.type == field.TYPE_INT64:
        return int(rng.choice([*INTS, 2**63 - 1, -(2**63), 2**32, 2**32 - 1]))
    return int(rng.choice(INTS))


def _params(rng: np.random.Generator) -> pb.SamplingParameters:
    """Some fields set: sane values, and now and then (rate drawn per request) a wild one."""
    p, wild_rate = pb.SamplingParameters(), float(rng.choice([0.0, 0.1, 0.5]))
    for field in p.DESCRIPTOR.fields:
        if rng.random() < 0.5:
            continue
        wild = rng.random() < wild_rate
        if field.name == "stop":
            p.stop.extend(_text(rng) for _ in range(int(rng.integers(0, 40 if wild else 3))))
        elif field.name == "stop_token_ids":
            p.stop_token_ids.extend(int(rng.choice(INTS) if wild else rng.integers(3, 200))
                                    for _ in range(int(rng.integers(0, 4))))
        elif field.name == "logit_bias":  # wild: past 300 ids, ids outside the vocabulary, NaN
            for _ in range(int(rng.integers(0, 400 if wild else 4))):
                token = int(rng.choice(INTS) if wild else rng.integers(3, 200))
                p.logit_bias[token] = float(rng.choice(FLOATS) if wild else rng.uniform(-100, 100))
        else:
            value = _wild(rng, field) if wild else SANE[field.name][int(rng.integers(len(SANE[field.name])))]
            setattr(p, field.name, value)
    if p.HasField("min_tokens") and p.HasField("max_tokens") and not wild_rate:
        p.min_tokens = min(p.min_tokens, p.max_tokens)
    return p


def _structured(rng: np.random.Generator) -> bytes:
    req = pb.GenerateRequest(request_id=rng.choice(["", "dup", _text(rng)]), params=_params(rng))
    kind = rng.choice(3, p=[0.45, 0.45, 0.1])  # text, token ids, no prompt
    if kind == 0:
        req.text = _text(rng)
    elif kind == 1:
        wild = rng.random() < 0.3
        pick = lambda: rng.choice(INTS) if wild and rng.random() < 0.1 else rng.integers(0, 256)
        req.token_ids.ids.extend(int(pick()) for _ in range(int(rng.integers(0, 140 if wild else 40))))
    wire = req.SerializeToString()
    if rng.random() < 0.2:  # a field this server's proto does not define (varint, number 20..99)
        number = int(rng.integers(20, 100))
        wire += bytes([(number << 3) & 0x7F | 0x80, number >> 4, 1])
    return wire


def _mutated(rng: np.random.Generator) -> bytes:
    base = bytearray(request_for(_text(rng) or "x", SamplingParams(
        temperature=0.7, top_p=0.9, seed=3, max_tokens=8, stop=["zz"], logprobs=2)).SerializeToString())
    for _ in range(int(rng.integers(1, 4))):
        op, at = rng.integers(0, 3), int(rng.integers(0, len(base)))
        if op == 0:
            base[at] = int(rng.integers(0, 256))
        elif op == 1:
            del base[at:at + int(rng.integers(1, 4))]
        else:
            base[at:at] = rng.bytes(int(rng.integers(1, 4)))
    return bytes(base)


def _bodies(seed: int) -> list[tuple[str, bytes]]:
    rng = np.random.default_rng(seed)
    out: list[tuple[str, bytes]] = []
    for i in range(N_CALLS):
        r = rng.random()
        if i % 10 == 9:  # the unary calls get random bytes too
            out.append((str(rng.choice(["Tokenize", "Detokenize", "GetModelInfo"])),
                        rng.bytes(int(rng.integers(0, 64)))))
        elif r < 0.2:
            out.append(("Generate", rng.bytes(int(rng.integers(0, 120)))))
        elif r < 0.5:
            out.append(("Generate", _mutated(rng)))
        else:
            out.append(("Generate", _structured(rng)))
    return out


@pytest.fixture(scope="module")
def served(server_engine):
    want = LLM.from_engine(server_engine).generate(["After the fuzz"], GOOD)[0]
    server = GenerationServer(server_engine, model_name="native-tiny", port=0).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield server, channel, want
    finally:
        channel.close()
        server.shutdown(grace_s=0)


def _one(channel: grpc.Channel, method: str, body: bytes, t_end: float) -> grpc.StatusCode | None:
    """The call's final status (None: skipped, past the time budget)."""
    if time.monotonic() > t_end:
        return None
    path = f"/hybrid_jax.v1.Generation/{method}"
    try:
        if method == "Generate":
            call = channel.unary_stream(path, request_serializer=lambda b: b,
                                        response_deserializer=pb.GenerateResponse.FromString)
            msgs = list(call(body, timeout=30))
            assert msgs and msgs[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
        else:
            channel.unary_unary(path, request_serializer=lambda b: b,
                                response_deserializer=lambda b: b)(body, timeout=30)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def test_random_and_mutated_requests_never_break_the_server(served):
    server, channel, want = served
    bodies = _bodies(seed=17)
    t_end = time.monotonic() + BUDGET_S
    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda mb: _one(channel, *mb, t_end), bodies))
    done = [(mb, c) for mb, c in zip(bodies, codes, strict=True) if c is not None]
    bad = [(m, b[:40], c) for (m, b), c in done if c not in ALLOWED]
    assert not bad, bad[:5]
    assert len(done) >= N_CALLS // 2, f"only {len(done)} calls within {BUDGET_S}s"
    seen = {c for _, c in done}
    assert {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT} <= seen  # the fuzz reached both sides
    stream = channel.unary_stream("/hybrid_jax.v1.Generation/Generate",
                                  request_serializer=pb.GenerateRequest.SerializeToString,
                                  response_deserializer=pb.GenerateResponse.FromString)
    msgs = list(stream(request_for("After the fuzz", GOOD), timeout=60))
    assert [t for m in msgs for t in m.token_ids] == want.token_ids
    wait_for(lambda: server.core.num_live() == 0, what="every fuzz stream to close")
    stats = server.core.stats()
    assert stats["slots_in_use"] == 0 and sum(stats["pages_in_use"].values()) == 0
    assert server.core.healthy
