"""A small gRPC client for `hybrid_jax.v1.Generation`, and the `hybrid-jax client` command.

    from serving.entrypoints.grpc.client import GenerationClient
    with GenerationClient("localhost:50051") as c:
        for msg in c.generate("Hello", max_tokens=16, temperature=0.0):
            print(msg.text, end="")

`GenerationClient.generate` builds a `GenerateRequest` from keyword arguments named
like `SamplingParams` fields (unset ones take the server's defaults) and yields the
server's `GenerateResponse` messages; gRPC errors surface as `grpc.RpcError`. This
module imports no JAX and knows nothing of the engine: it only speaks the proto.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
from google.protobuf.json_format import MessageToDict

from serving.entrypoints.cli_args import add_client_args  # noqa: F401  (its home before; argparse only)
from serving.proto.hybrid_jax.v1 import generation_pb2 as pb
from serving.proto.hybrid_jax.v1 import generation_pb2_grpc as pb_grpc

_PARAMS = {f.name for f in pb.SamplingParameters.DESCRIPTOR.fields}


def make_request(prompt: str | Sequence[int], *, request_id: str = "",
                 **params: object) -> pb.GenerateRequest:
    """A GenerateRequest: text or token ids, plus sampling fields (None = unset)."""
    unknown = set(params) - _PARAMS
    if unknown:
        raise ValueError(f"unknown sampling fields {sorted(unknown)}; known: {sorted(_PARAMS)}")
    set_params = {k: v for k, v in params.items() if v is not None}
    req = pb.GenerateRequest(request_id=request_id, params=pb.SamplingParameters(**set_params))
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


def open_channel(target: str, *, tls: bool = False, tls_ca: str | Path | None = None) -> grpc.Channel:
    """A channel to `target`: plaintext, or TLS (tls=True: the system's roots; tls_ca: that PEM)."""
    if not tls and tls_ca is None:
        return grpc.insecure_channel(target)
    roots = None
    if tls_ca is not None:
        if not Path(tls_ca).is_file():
            raise FileNotFoundError(f"--tls-ca {tls_ca}: no such file")
        roots = Path(tls_ca).read_bytes()
    return grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=roots))


class GenerationClient:
    """A channel to one server; use as a context manager or call `close()`.

    tls / tls_ca: see `open_channel`. api_key: sent as `authorization: Bearer <key>`.
    """

    def __init__(self, target: str, *, tls: bool = False, tls_ca: str | Path | None = None,
                 api_key: str | None = None):
        self.channel = open_channel(target, tls=tls, tls_ca=tls_ca)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None

    def generate(self, prompt: str | Sequence[int], *, timeout: float | None = None, request_id: str = "",
                 **params: object) -> Iterator[pb.GenerateResponse]:
        """Stream the response messages; the last has finish_reason and usage set."""
        yield from self.stub.Generate(make_request(prompt, request_id=request_id, **params),
                                      timeout=timeout, metadata=self.metadata)

    def model_info(self, timeout: float | None = None) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout, metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_client(args: argparse.Namespace) -> int:
    """Stream one prompt (prompt, then continuation) to stdout; 1 and the status on errors."""
    with GenerationClient(args.server, tls=args.tls, tls_ca=args.tls_ca, api_key=args.api_key) as client:
        try:
            if args.info:
                print(json.dumps(MessageToDict(client.model_info(timeout=args.timeout)), indent=2))
                return 0
            if args.prompt is None:
                print("error: give a prompt (or --info)", file=sys.stderr)
                return 2
            params = {name: getattr(args, name) for name in (
                "max_tokens", "temperature", "top_k", "top_p", "min_p", "min_tokens", "seed",
                "stop", "stop_token_ids", "ignore_eos")}
            print(args.prompt, end="", flush=True)
            last = None
            for last in client.generate(args.prompt, timeout=args.timeout, request_id=args.request_id,
                                        **params):
                print(last.text, end="", flush=True)
            print()
        except grpc.RpcError as err:
            print(f"\nerror: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    if args.usage and last is not None:
        reason = pb.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()
        print(f"finish_reason={reason} prompt_tokens={last.usage.prompt_tokens} "
              f"completion_tokens={last.usage.completion_tokens}", file=sys.stderr)
    return 0
