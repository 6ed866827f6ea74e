"""Safe network defaults: 127.0.0.1 by default (gRPC and metrics), TLS with a self-signed
certificate made here, and the API key (UNAUTHENTICATED without it; health stays open)."""

from __future__ import annotations

import http.client
import inspect
import json
import shutil
import ssl
import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.entrypoints.cli_args import build_parser
from serving.entrypoints.grpc.client import GenerationClient, open_channel
from serving.entrypoints.grpc.security import tls_credentials
from serving.entrypoints.grpc.server import GenerationServer
from serving.entrypoints.llm import LLM
from serving.entrypoints.openai.api_server import OpenAIConfig
from serving.proto.hybrid_jax.v1 import generation_pb2 as pb
from serving.proto.hybrid_jax.v1 import generation_pb2_grpc as pb_grpc
from serving.sample.sampling_params import SamplingParams
from tests.serving.server_helpers import listening, metric_samples, rejected, rpc_code

KEY = "s3cret-token"
GOOD = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _self_signed(tmp_path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 / localhost and its key, made by the openssl CLI."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    cert, key = tmp_path / "server.crt", tmp_path / "server.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "1", "-subj", "/CN=localhost", "-keyout", str(key), "-out", str(cert),
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return str(cert), str(key)


@pytest.fixture(scope="module")
def served(server_engine, tmp_path_factory):
    """(server, CA file, expected greedy output) for a TLS + API key server on 127.0.0.1."""
    cert, key = _self_signed(tmp_path_factory.mktemp("tls"))
    want = LLM.from_engine(server_engine).generate(["Secure hello"], GOOD)[0]
    http = OpenAIConfig(port=0, model_name="native-tiny", tls_cert=cert, tls_key=key)
    server = GenerationServer(server_engine, model_name="native-tiny", port=0, metrics_port=0,
                              tls=tls_credentials(cert, key), api_key=KEY, http=http).start()
    try:
        yield server, cert, want
    finally:
        server.shutdown(grace_s=0)


def test_defaults_bind_localhost_only():
    assert inspect.signature(GenerationServer).parameters["host"].default == "127.0.0.1"
    assert build_parser().parse_args(["serve"]).host == "127.0.0.1"


def test_grpc_and_metrics_listen_on_127_0_0_1_and_nowhere_else(served):
    server = served[0]
    for port in (server.port, server.metrics_port):
        addrs = listening(port)
        assert addrs and set(addrs) == {"127.0.0.1"}, (port, addrs)


def test_tls_and_the_key_serve_the_expected_stream(served):
    server, ca, want = served
    with GenerationClient(f"127.0.0.1:{server.port}", tls_ca=ca, api_key=KEY) as client:
        msgs = list(client.generate("Secure hello", timeout=60, temperature=0.0, max_tokens=6,
                                    ignore_eos=True))
        assert [t for m in msgs for t in m.token_ids] == want.token_ids
        assert "".join(m.text for m in msgs) == want.text
        assert client.model_info(timeout=10).model == "native-tiny"


def test_https_serves_the_same_tokens_and_plain_http_gets_nothing(served):
    server, ca, want = served
    ctx = ssl.create_default_context(cafile=ca)
    conn = http.client.HTTPSConnection("127.0.0.1", server.http_port, context=ctx, timeout=60)
    body = {"model": "native-tiny", "prompt": "Secure hello", "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read())["choices"][0]["token_ids"] == want.token_ids
    conn.close()
    plain = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=10)
    with pytest.raises((http.client.HTTPException, ConnectionError, OSError)):
        plain.request("GET", "/health")
        plain.getresponse()
    plain.close()


def test_plaintext_client_gets_no_answer_from_the_tls_server(served):
    server = served[0]
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        health = health_pb2_grpc.HealthStub(ch)
        code, _ = rpc_code(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=5))
        assert code == grpc.StatusCode.UNAVAILABLE


def test_calls_without_the_right_key_are_unauthenticated_and_counted(served):
    server, ca, _ = served
    before = rejected(metric_samples(server.metrics_port), "UNAUTHENTICATED", "unauthenticated")
    with open_channel(f"127.0.0.1:{server.port}", tls_ca=ca) as ch:
        stub = pb_grpc.GenerationStub(ch)
        calls = {"no key": None, "wrong key": (("authorization", "Bearer nope"),),
                 "not bearer": (("authorization", KEY),)}
        for what, metadata in calls.items():
            code, details = rpc_code(lambda m=metadata: list(stub.Generate(
                pb.GenerateRequest(text="hi"), timeout=10, metadata=m)))
            assert code == grpc.StatusCode.UNAUTHENTICATED, what
            assert ("missing" if metadata is None else "wrong") in details and "Bearer" in details
        code, _ = rpc_code(lambda: stub.Tokenize(pb.TokenizeRequest(text="hi"), timeout=10))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        code, _ = rpc_code(lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        # Health stays open: load balancers probe without the token.
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        ids = stub.Tokenize(pb.TokenizeRequest(text="hi"), timeout=10,
                            metadata=(("authorization", f"Bearer {KEY}"),)).token_ids
        assert len(ids) >= 2
    after = rejected(metric_samples(server.metrics_port), "UNAUTHENTICATED", "unauthenticated")
    assert after - before == 5


def test_missing_or_broken_tls_files_are_named(tmp_path):
    pem, junk = tmp_path / "ok.pem", tmp_path / "junk.pem"
    pem.write_text("-----BEGIN PRIVATE KEY-----\n")
    junk.write_text("not a key")
    with pytest.raises(FileNotFoundError, match="--tls-cert .*none.crt"):
        tls_credentials(tmp_path / "none.crt", pem)
    with pytest.raises(ValueError, match="--tls-key .*not a PEM"):
        tls_credentials(pem, junk)
