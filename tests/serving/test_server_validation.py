"""Bad requests get INVALID_ARGUMENT naming the field, and the server keeps serving;
Tokenize, Detokenize and GetModelInfo answer from the engine's model."""

from __future__ import annotations

import grpc
import pytest

from serving.entrypoints.grpc.server import GenerationServer
from serving.entrypoints.llm import LLM
from serving.proto.hybrid_jax.v1 import generation_pb2 as pb
from serving.proto.hybrid_jax.v1 import generation_pb2_grpc as pb_grpc
from serving.sample.sampling_params import SamplingParams
from tests.serving.server_helpers import collect, request_for, rpc_code

GOOD = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def served(server_engine):
    """(server, stub, a raw-bytes Generate callable, the expected output of a good request)."""
    want = LLM.from_engine(server_engine).generate(["Still serving"], GOOD)[0]
    server = GenerationServer(server_engine, model_name="native-tiny", host="127.0.0.1", port=0).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    raw = channel.unary_stream("/hybrid_jax.v1.Generation/Generate", request_serializer=lambda b: b,
                               response_deserializer=pb.GenerateResponse.FromString)
    try:
        yield server, pb_grpc.GenerationStub(channel), raw, want
    finally:
        channel.close()
        server.shutdown(grace_s=0)


def _p(**fields) -> pb.SamplingParameters:
    return pb.SamplingParameters(**fields)


BAD = {
    "empty text": (pb.GenerateRequest(text=""), "text"),
    "no prompt": (pb.GenerateRequest(), "prompt"),
    "empty token_ids": (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[])), "token_ids"),
    "too long": (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 128)), "max_model_len"),
    "too long text": (pb.GenerateRequest(text="x" * 200), "max_model_len"),
    "id over vocab": (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 264])), "token_ids"),
    "negative id": (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[-1, 5])), "token_ids"),
    "temperature": (pb.GenerateRequest(text="a", params=_p(temperature=-0.5)), "params.temperature"),
    "top_p zero": (pb.GenerateRequest(text="a", params=_p(top_p=0.0)), "params.top_p"),
    "top_p above 1": (pb.GenerateRequest(text="a", params=_p(top_p=1.5)), "params.top_p"),
    "top_k": (pb.GenerateRequest(text="a", params=_p(top_k=-2)), "params.top_k"),
    "max_tokens zero": (pb.GenerateRequest(text="a", params=_p(max_tokens=0)), "params.max_tokens"),
    "max_tokens negative": (pb.GenerateRequest(text="a", params=_p(max_tokens=-3)), "params.max_tokens"),
    "max_tokens past max_model_len": (pb.GenerateRequest(text="a", params=_p(max_tokens=500)),
                                      "params.max_tokens"),
    "min_p": (pb.GenerateRequest(text="a", params=_p(min_p=2.0)), "params.min_p"),
    "logprobs": (pb.GenerateRequest(text="a", params=_p(logprobs=99)), "params.logprobs"),
    "stop id over vocab": (pb.GenerateRequest(text="a", params=_p(stop_token_ids=[9999])),
                           "params.stop_token_ids"),
    "logit_bias id over vocab": (pb.GenerateRequest(text="a", params=_p(logit_bias={9999: 1.0})),
                                 "params.logit_bias"),
    "logit_bias negative id": (pb.GenerateRequest(text="a", params=_p(logit_bias={-4: 1.0})),
                               "params.logit_bias"),
    "logit_bias value": (pb.GenerateRequest(text="a", params=_p(logit_bias={5: 200.0})), "params.logit_bias"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_invalid_field_is_named_and_the_server_keeps_serving(served, case):
    server, stub, raw, want = served
    request, field = BAD[case]
    code, details = rpc_code(lambda: list(stub.Generate(request, timeout=30)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert field in details
    got = collect(stub, request_for("Still serving", GOOD))
    assert got.token_ids == want.token_ids


def _with_unknown(wire: bytes, field_number: int) -> bytes:
    """Append a varint field that the server's proto does not define (as a newer client would)."""
    return wire + bytes([(field_number << 3) & 0x7F | 0x80, field_number >> 4, 1])


@pytest.mark.parametrize("where", ["request", "params"])
def test_unknown_fields_are_rejected_by_number(served, where):
    server, stub, raw, want = served
    good = request_for("Still serving", GOOD)
    if where == "request":
        wire, name = _with_unknown(good.SerializeToString(), 77), "#77"
    else:
        params = _with_unknown(good.params.SerializeToString(), 40)
        wire = pb.GenerateRequest(text="Still serving").SerializeToString()
        wire += bytes([(4 << 3) | 2, len(params)]) + params  # field 4 (params), length-delimited
        name = "params.#40"
    code, details = rpc_code(lambda: list(raw(wire, timeout=30)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert name in details and "unknown field" in details
    assert list(raw(good.SerializeToString(), timeout=30))[-1].usage.completion_tokens == 5


def test_a_live_request_id_cannot_be_reused(served):
    server, stub, raw, want = served
    long = request_for("x", SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True), "dup")
    call = stub.Generate(long, timeout=60)
    next(call)
    code, details = rpc_code(lambda: list(stub.Generate(long, timeout=30)))
    call.cancel()
    assert code == grpc.StatusCode.ALREADY_EXISTS and "request_id" in details


def test_logprobs_are_streamed_when_asked(served):
    server, stub, raw, want = served
    msgs = list(stub.Generate(request_for("Still serving", SamplingParams(
        temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)), timeout=30))
    entries = [lp for m in msgs for lp in m.logprobs]
    assert [e.token_id for e in entries] == want.token_ids[:4]
    for e in entries:
        assert len(e.top) == 3 and e.top[0].logprob >= e.top[1].logprob >= e.top[2].logprob
        assert e.top[0].token_id == e.token_id and e.logprob == pytest.approx(e.top[0].logprob)  # greedy


def test_tokenize_detokenize_and_model_info(served, server_engine):
    server, stub, raw, want = served
    ids = stub.Tokenize(pb.TokenizeRequest(text="Hi there"), timeout=10).token_ids
    assert list(ids) == server_engine.tokenizer.encode("Hi there", add_bos=True)
    no_bos = stub.Tokenize(pb.TokenizeRequest(text="Hi there", add_bos=False), timeout=10).token_ids
    assert list(no_bos) == list(ids)[1:]
    assert stub.Detokenize(pb.DetokenizeRequest(token_ids=ids), timeout=10).text == "Hi there"
    code, details = rpc_code(lambda: stub.Detokenize(pb.DetokenizeRequest(token_ids=[999]), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "token_ids" in details
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    cfg = server_engine.model_config
    assert info.model == "native-tiny" and info.architecture == cfg.architecture
    assert info.vocab_size == cfg.vocab_size and info.max_model_len == 128 and info.dtype == "float32"
    assert [(x.kind, x.window if x.HasField("window") else None) for x in info.layers] == \
        [(s.kind.value, s.window) for s in cfg.layers]
    assert [g.window for g in info.kv_groups] == [w for w in cfg.windows]
    assert info.ssm_state_size == cfg.mamba2.state_size and info.state_bytes_per_slot > 0
    # The weights as held: the runner's packed f32 buffers, no FP8.
    assert info.weight_bytes == sum(b.nbytes for b in server_engine.runner.params) > 0
    assert dict(info.weight_bytes_by_dtype) == {"float32": info.weight_bytes} and info.quantization == ""
    assert info.kv_cache_dtype == "float32"  # the pages' dtype (float8_e4m3fn with kv_cache_dtype="fp8")


def test_logit_bias_is_served_over_grpc(served):
    server, stub, raw, want = served
    ban = want.token_ids[0]
    got = collect(stub, request_for("Still serving", SamplingParams(
        temperature=0.0, max_tokens=5, ignore_eos=True, logit_bias={ban: -100.0})))
    assert len(got.token_ids) == 5 and ban not in got.token_ids
    assert collect(stub, request_for("Still serving", GOOD)).token_ids == want.token_ids  # slot reset

