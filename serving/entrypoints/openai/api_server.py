"""The OpenAI-compatible HTTP server: routes, auth, errors, and its uvicorn thread.

    http = OpenAIServer(core, metrics, OpenAIConfig(port=8000, model_name="m", model_dir=path),
                        host="127.0.0.1", limits=limits, api_key=None, health=server.is_serving)
    http.start(); ...; http.stop()

Endpoints (one small handler each): GET /v1/models (and /v1/models/{id}), POST
/v1/completions, POST /v1/chat/completions, POST /tokenize and /detokenize (vLLM's), GET
/health (200 while `health()` says the engine serves, else 503) and GET /metrics (the
server's Prometheus series, as on --metrics-port); those two never need the API key.
With an API key every other path needs `Authorization: Bearer KEY` (401 otherwise).
Every refusal is OpenAI's error body `{"error": {"message", "type", "param", "code"}}`:
400 a bad field (named in `param`),
401, 404 an unknown model or path, 405, 413 a body over --max-request-bytes, 429 the
waiting queue is full, 503 shutting down; each is logged and counted like gRPC's
(`requests_rejected_total{code,reason}` with the gRPC code name).

The app is Starlette on uvicorn, run in its own thread with its own asyncio loop;
the engine loop keeps its thread (see `serving.entrypoints.async_engine` for how the two meet). The
socket is bound in the constructor, so a port in use fails before anything starts.
This module knows nothing of gRPC.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from serving.engine.engine_core import EngineCore
from serving.entrypoints.async_engine import AsyncEngineClient
from serving.entrypoints.metrics import ServerMetrics
from serving.entrypoints.openai.chat_template import ChatTemplate
from serving.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from serving.entrypoints.openai.serving_chat import create_chat_completion
from serving.entrypoints.openai.serving_common import ERRORS, ApiError, Front, from_validation
from serving.entrypoints.openai.serving_completion import create_completion
from serving.entrypoints.openai.serving_tokenization import detokenize, tokenize
from serving.entrypoints.request_log import log_event
from serving.entrypoints.validation import RequestLimits

log = logging.getLogger(__name__)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class OpenAIConfig:
    """What the HTTP front serves beside gRPC (the CLI's --http-* flags)."""

    port: int = 8000  # 0: any free port
    model_name: str = "model"  # the id clients send as `model` (--served-model-name)
    model_dir: str | None = None  # where the chat template is looked for
    chat_template: str | None = None  # a template file that overrides the model's
    default_chat_template_kwargs: dict = field(default_factory=dict)
    profile_dir: str | None = None  # --profile-dir: POST /start_profile and /stop_profile
    tls_cert: str | None = None  # --tls-cert / --tls-key: HTTPS with gRPC's certificate
    tls_key: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.default_chat_template_kwargs, dict):
            raise ValueError("--default-chat-template-kwargs must be a JSON object, e.g. "
                             "'{\"enable_thinking\": false}'")


def build_app(front: Front, *, api_key: str | None, health: Callable[[], bool],
              profiler=None) -> Starlette:
    """The Starlette app over `front` (routes and error handling; no socket). `profiler`
    (serving/entrypoints/profiling.py's ServerProfiler) adds POST /start_profile and
    /stop_profile, behind the API key like every route but /health."""
    expected = f"Bearer {api_key}".encode() if api_key else None

    def refuse(err: ApiError, request: Request) -> JSONResponse:
        code = ERRORS.get(err.status, ERRORS[500])[1]
        front.metrics.rejected.labels(code, err.reason).inc()
        log_event("request.rejected", logging.WARNING, code=code, status=err.status, reason=err.reason,
                  details=err.message, param=err.param, path=request.url.path,
                  peer=request.client.host if request.client else None)
        return JSONResponse(err.body(), status_code=err.status)

    def endpoint(handler: Callable[[Request], Awaitable[Response]]):
        async def run(request: Request) -> Response:
            try:
                if expected is not None:
                    given = request.headers.get("authorization", "")
                    if not hmac.compare_digest(given.encode(), expected):
                        what = "wrong API key" if given else "missing API key"
                        raise ApiError(401, f"{what}: send the header 'Authorization: Bearer <key>'", None,
                                       "unauthenticated")
                return await handler(request)
            except ApiError as err:
                return refuse(err, request)
        return run

    async def parse(request: Request,
                    model: type[BaseModel] | Callable[[bytes], type[BaseModel]]) -> BaseModel:
        """The body as `model` (or as the model `model(body)` picks from the raw bytes)."""
        size = request.headers.get("content-length")
        limit = front.limits.max_request_bytes
        if size is not None and size.isdigit() and int(size) > limit:
            raise ApiError(413, f"request: {size} bytes exceeds the limit of {limit} bytes "
                           "(--max-request-bytes)", None, "too_large")
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise ApiError(413, f"request: more than {limit} bytes (--max-request-bytes)", None,
                               "too_large")
        if not isinstance(model, type):
            model = model(bytes(body))
        try:
            return model.model_validate_json(bytes(body))
        except ValidationError as err:
            raise from_validation(err) from None

    async def answer(result, request: Request) -> Response:
        if result is None:  # the client left; nobody reads this
            return Response(status_code=499)
        if isinstance(result, BaseModel):
            return Response(result.model_dump_json(), media_type="application/json")
        return StreamingResponse(result, media_type="text/event-stream", headers=SSE_HEADERS)

    async def completions(request: Request) -> Response:
        body = await parse(request, CompletionRequest)
        return await answer(await create_completion(front, body, request.is_disconnected), request)

    async def chat_completions(request: Request) -> Response:
        body = await parse(request, ChatCompletionRequest)
        return await answer(await create_chat_completion(front, body, request.is_disconnected), request)

    def tokenize_form(body: bytes) -> type[BaseModel]:  # messages: the chat form
        try:
            chat = isinstance(data := json.loads(body), dict) and "messages" in data
        except ValueError:
            chat = False  # the completion form's validation names the JSON error
        return TokenizeChatRequest if chat else TokenizeCompletionRequest

    async def tokenize_route(request: Request) -> Response:
        body = await parse(request, tokenize_form)
        return Response(tokenize(front, body).model_dump_json(), media_type="application/json")

    async def detokenize_route(request: Request) -> Response:
        body = await parse(request, DetokenizeRequest)
        return Response(detokenize(front, body).model_dump_json(), media_type="application/json")

    def card() -> ModelCard:
        return ModelCard(id=front.model_name, created=created, max_model_len=front.max_model_len,
                         vocab_size=front.vocab_size)

    async def models(request: Request) -> Response:
        return Response(ModelList(data=[card()]).model_dump_json(), media_type="application/json")

    async def model_card(request: Request) -> Response:  # GET /v1/models/{id}: OpenAI's retrieve
        front.check_model(request.path_params["model"])
        return Response(card().model_dump_json(), media_type="application/json")

    async def metrics(request: Request) -> Response:  # the --metrics-port series, on this port too
        return Response(generate_latest(front.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def health_check(request: Request) -> Response:
        return Response(status_code=200 if health() else 503)

    async def start_profile(request: Request) -> Response:
        try:
            await asyncio.to_thread(profiler.start)
        except ValueError as err:
            raise ApiError(409, str(err), None, "profile_state") from None
        return JSONResponse({"profiling": True, "trace": profiler.trace, "dir": str(profiler.directory)})

    async def stop_profile(request: Request) -> Response:
        try:
            return JSONResponse({"profiling": False, **await asyncio.to_thread(profiler.stop)})
        except ValueError as err:
            raise ApiError(409, str(err), None, "profile_state") from None

    async def http_error(request: Request, exc: HTTPException) -> Response:
        what = {404: f"no such path: {request.url.path}", 405: f"{request.method} is not allowed on "
                f"{request.url.path}"}.get(exc.status_code, str(exc.detail))
        status = exc.status_code if exc.status_code in ERRORS else 400
        return refuse(ApiError(status, what, None, "bad_path"), request)

    async def client_gone(request: Request, exc: ClientDisconnect) -> Response:
        return Response(status_code=499)

    async def server_error(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error on %s", request.url.path)
        return refuse(ApiError(500, f"internal error: {type(exc).__name__}", None, "internal"), request)

    created = int(time.time())
    routes = [Route("/v1/models", endpoint(models), methods=["GET"]),
              Route("/v1/models/{model:path}", endpoint(model_card), methods=["GET"]),
              Route("/v1/completions", endpoint(completions), methods=["POST"]),
              Route("/v1/chat/completions", endpoint(chat_completions), methods=["POST"]),
              Route("/tokenize", endpoint(tokenize_route), methods=["POST"]),
              Route("/detokenize", endpoint(detokenize_route), methods=["POST"]),
              # without the API key: load balancers and Prometheus
              Route("/health", health_check, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"])]
    if profiler is not None:
        routes += [Route("/start_profile", endpoint(start_profile), methods=["POST"]),
                   Route("/stop_profile", endpoint(stop_profile), methods=["POST"])]
    handlers = {HTTPException: http_error, ClientDisconnect: client_gone, Exception: server_error}
    return Starlette(routes=routes, exception_handlers=handlers)


class OpenAIServer:
    """The app on `host:port` in a uvicorn thread, over the same engine core as gRPC."""

    def __init__(self, core: EngineCore, metrics: ServerMetrics, config: OpenAIConfig, *,
                 host: str = "127.0.0.1", limits: RequestLimits | None = None, api_key: str | None = None,
                 health: Callable[[], bool] | None = None):
        engine = core.engine
        template = ChatTemplate.from_model_dir(config.model_dir, config.chat_template)
        self.client = AsyncEngineClient(core, name="http-engine")
        self.front = Front(self.client, metrics, config.model_name, engine.tokenizer,
                           engine.model_config.vocab_size, engine.plan.scheduler.max_model_len,
                           limits or RequestLimits(), template, dict(config.default_chat_template_kwargs))
        self.profiler = None
        if config.profile_dir is not None:
            from serving.entrypoints.profiling import ServerProfiler

            self.profiler = ServerProfiler(engine, config.profile_dir)
        self.app = build_app(self.front, api_key=api_key, health=health or (lambda: core.healthy),
                             profiler=self.profiler)
        self.host = host
        self._sock = _bind(host, config.port)
        self.port = self._sock.getsockname()[1]
        self.tls = config.tls_cert is not None
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", access_log=False,
                                                     lifespan="off", timeout_graceful_shutdown=5,
                                                     ssl_certfile=config.tls_cert,
                                                     ssl_keyfile=config.tls_key))
        self._thread = threading.Thread(target=self._run, name="http-server", daemon=True)

    def _run(self) -> None:
        async def serve() -> None:
            self.client.bind(asyncio.get_running_loop())
            await self._server.serve(sockets=[self._sock])
        asyncio.run(serve())

    def start(self) -> OpenAIServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._server.started:
            raise OSError(f"the HTTP server did not start on {self.host}:{self.port}")
        log_event("server.http_started", host=self.host, port=self.port, tls=self.tls,
                  model=self.front.model_name, chat_template=self.front.chat_template is not None)
        return self

    def stop(self) -> None:
        if self.profiler is not None and self.profiler.running:
            self.profiler.stop()  # keep what was traced
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self.client.close()
        self._sock.close()


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (IPv6 when the host is one), or OSError naming the flag."""
    bare = host.strip("[]")
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET
    try:
        sock = socket.create_server((bare, port), family=family, backlog=2048)
    except OSError as err:
        raise OSError(f"cannot listen on {host}:{port} for HTTP: {err.strerror or err} (--http-port, "
                      "--host)") from err
    sock.setblocking(False)
    return sock


def model_dir_of(model: str) -> str | None:
    """The directory a --model resolved to, where its chat template lives (None: a preset)."""
    path = Path(model)
    return str(path) if path.is_dir() else None
