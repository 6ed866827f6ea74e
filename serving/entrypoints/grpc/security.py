"""Transport security of the server: TLS credentials and a shared API key.

    creds = tls_credentials("server.crt", "server.key")      # PEM files
    interceptor = ApiKeyInterceptor("s3cret", on_reject=...)  # authorization: Bearer s3cret

`ApiKeyInterceptor` (a `grpc.aio.ServerInterceptor`: the server is a `grpc.aio` one) lets
a call through when its `authorization` metadata is `Bearer <key>` (compared in constant
time) and answers UNAUTHENTICATED otherwise; the standard health service stays open, so
load balancers need no token. This
module knows nothing of the engine or of the Generation service.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from pathlib import Path

import grpc
import grpc.aio

OPEN_PREFIXES = ("/grpc.health.v1.Health/",)  # answered without a token


def tls_credentials(cert_file: str | Path, key_file: str | Path) -> grpc.ServerCredentials:
    """Server credentials from a PEM certificate chain and its PEM private key.

    FileNotFoundError / ValueError name the file and the flag, before anything is bound.
    """
    pems = []
    for path, flag in ((key_file, "--tls-key"), (cert_file, "--tls-cert")):
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{flag} {path}: no such file")
        data = path.read_bytes()
        if b"-----BEGIN" not in data:
            raise ValueError(f"{flag} {path}: not a PEM file")
        pems.append(data)
    return grpc.ssl_server_credentials([(pems[0], pems[1])])


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuse calls without `authorization: Bearer <key>` (health checks excepted).

    `on_reject(method, token_given)` is called once per refused call (to count and log
    it); it must not raise.
    """

    def __init__(self, key: str, on_reject: Callable[[str, bool], None] | None = None):
        if not key:
            raise ValueError("api_key must be a non-empty string")
        self._expected = f"Bearer {key}".encode()
        self._on_reject = on_reject

    async def intercept_service(self, continuation, handler_call_details: grpc.HandlerCallDetails):
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        given = [v for k, v in handler_call_details.invocation_metadata or () if k == "authorization"]
        if given and hmac.compare_digest(_bytes(given[0]), self._expected):
            return handler
        if self._on_reject is not None:
            self._on_reject(method, bool(given))
        what = "wrong API key" if given else "missing API key"
        return _refusal(handler, f"{what}: send metadata 'authorization: Bearer <key>'")


def _bytes(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


def _refusal(handler: grpc.RpcMethodHandler, details: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind (and (de)serializers) that answers UNAUTHENTICATED."""

    async def deny(request_or_iterator, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, details)

    async def deny_stream(request_or_iterator, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, details)
        yield  # pragma: no cover - unreachable; makes this an async generator

    kinds = {(False, False): grpc.unary_unary_rpc_method_handler,
             (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler,
             (True, True): grpc.stream_stream_rpc_method_handler}
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(deny_stream if handler.response_streaming else deny,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
