"""The `hybrid_jax.v1.Generation` servicer: gRPC calls onto the engine core.

The servicer runs on the `grpc.aio` server's event loop (one thread for every call):
each `Generate` call is a coroutine that checks the request
(`serving.entrypoints.validation`), submits it to the `EngineCore` and forwards the request's
deltas as `GenerateResponse` messages. It meets the engine thread through an
`AsyncEngineClient` (`serving.entrypoints.async_engine`), as the HTTP front does: one
wake-up of the loop per engine step, not a thread woken per request and token. Status codes:

  INVALID_ARGUMENT     a bad field (named in the details), a body that does not parse,
                       or a request over a size limit; the server keeps serving
  RESOURCE_EXHAUSTED   the waiting queue is full, or the open-stream limit is reached
                       (nothing was queued)
  ALREADY_EXISTS       the client's request_id is live
  UNAVAILABLE          the server is shutting down (before or after acceptance)
  INTERNAL             the engine failed this request (finish_reason "error"); the
                       other requests go on

Every refusal is logged (`request.rejected`) and counted by code and reason. A
client cancel or an expired deadline ends the RPC; its done-callback aborts the request
in the engine at once (from the client's small thread pool, never blocking the loop),
which frees its pages and slot. `add_to_server` registers
the service with request parsing that cannot fail inside grpc (see
`validation.parse`). This module knows nothing of sockets, signals, credentials or
the process lifecycle (see `serving.entrypoints.grpc.server`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc
import grpc.aio

from serving.engine.engine_core import EngineCore, EngineStopped, QueueFull, RequestStream
from serving.engine.outputs import RequestDelta
from serving.entrypoints.async_engine import AsyncEngineClient
from serving.entrypoints.metrics import RequestTiming, ServerMetrics
from serving.entrypoints.request_log import log_event
from serving.entrypoints.validation import (
    EngineRequest,
    InvalidRequest,
    RequestLimits,
    Unparsed,
    check_known,
    outside_vocab,
    parse,
    to_engine_request,
)
from serving.proto.hybrid_jax.v1 import generation_pb2 as pb
from serving.proto.hybrid_jax.v1 import generation_pb2_grpc as pb_grpc

FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
                  "abort": pb.FINISH_REASON_ABORT}
SERVICE = "hybrid_jax.v1.Generation"
# method -> (kind, request type, response type)
METHODS = {"Generate": ("unary_stream", pb.GenerateRequest, pb.GenerateResponse),
           "Tokenize": ("unary_unary", pb.TokenizeRequest, pb.TokenizeResponse),
           "Detokenize": ("unary_unary", pb.DetokenizeRequest, pb.DetokenizeResponse),
           "GetModelInfo": ("unary_unary", pb.GetModelInfoRequest, pb.ModelInfo)}


def add_to_server(servicer: GenerationServicer, server: grpc.aio.Server) -> None:
    """Register the service; a body that does not parse reaches the handler as `Unparsed`."""
    handlers = {}
    for name, (kind, req_type, resp_type) in METHODS.items():
        make = getattr(grpc, f"{kind}_rpc_method_handler")
        handlers[name] = make(getattr(servicer, name), request_deserializer=_parser(
            req_type, servicer.limits.max_request_bytes), response_serializer=resp_type.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


def _parser(req_type, max_bytes: int) -> Callable[[bytes], object]:
    return lambda data: parse(req_type, data, max_bytes)


class GenerationServicer(pb_grpc.GenerationServicer):
    """Serves one engine core; `model_name` is reported by GetModelInfo.

    At most `max_streams` Generate calls are open at once (None: no limit of its own);
    one more is refused with RESOURCE_EXHAUSTED (counted), so the server's own call limit
    keeps room for health checks and unary calls. Every method runs on the server's event
    loop; `client` must deliver its wake-ups there (`AsyncEngineClient.bind`).
    """

    def __init__(self, core: EngineCore, metrics: ServerMetrics, *, model_name: str,
                 limits: RequestLimits | None = None, max_streams: int | None = None,
                 client: AsyncEngineClient | None = None):
        self.core, self.metrics, self.model_name = core, metrics, model_name
        self.client = client or AsyncEngineClient(core, name="grpc-engine")
        self.limits = limits or RequestLimits()
        self.max_streams = max_streams
        self._open = 0  # Generate calls open (touched only on the event loop)
        engine = core.engine
        self.tokenizer = engine.tokenizer
        self.vocab_size = engine.model_config.vocab_size
        self.max_model_len = engine.plan.scheduler.max_model_len

    # -- Generate ----------------------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest | Unparsed,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        """Stream one request's deltas; ends with a finished message or a status (see above)."""
        req = await self._accept(request, context)
        if self.max_streams and self._open >= self.max_streams:
            await self._reject(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"server busy: {self.max_streams} streams open (its limit); retry later",
                               req.request_id, "too_many_streams")
        self._open += 1  # one event loop: no lock needed
        try:
            async for msg in self._serve(req, context):
                yield msg
        finally:
            self._open -= 1

    async def _serve(self, req: EngineRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        timing = RequestTiming(time.monotonic(), len(req.prompt_token_ids))
        stream = await self._submit(req, context)
        self.metrics.request_accepted(timing)
        log_event("request.accepted", request_id=req.request_id, peer=context.peer(),
                  prompt_tokens=timing.prompt_tokens, max_tokens=req.params.max_tokens)
        watch = self.client.watch([stream])
        # A cancel or an expired deadline ends the RPC: abort the request in the engine at
        # once (frees its pages and slot), even if this generator is not resumed to run its
        # `finally` until later. A no-op once the request has finished.
        context.add_done_callback(lambda _: watch.close())
        finished, reason = False, "abort"

        async def gone() -> bool:
            return context.done()

        try:
            while not watch.done:
                got = await watch.next(gone)
                if got is None:  # the client is gone
                    return
                for _, delta in got:
                    timing.tokens(len(delta.token_ids), time.monotonic())
                    self.metrics.generation_tokens.inc(len(delta.token_ids))
                    if delta.finished:
                        finished, reason = True, delta.finish_reason or "stop"
                    if delta.finish_reason == "error":
                        await self._failed(req.request_id, delta, context)
                    if delta.finish_reason == "abort" and not context.done():
                        # Not the client's doing: the server aborted it (shutdown grace ran out).
                        n = delta.num_output_tokens
                        await context.abort(grpc.StatusCode.UNAVAILABLE, f"request {req.request_id} aborted "
                                            f"after {n} tokens: the server is shutting down")
                    yield _response(delta, req.params.logprobs)
        finally:
            watch.close()  # aborts the request if it has not finished (from the client's pool)
            if not finished:  # the client went away (cancel, deadline) or the handler failed
                log_event("request.cancelled", request_id=req.request_id,
                          completion_tokens=timing.output_tokens, deadline_passed=_deadline_passed(context))
            self._finished(req.request_id, timing, reason)

    async def _failed(self, request_id: str, delta: RequestDelta, context: grpc.aio.ServicerContext) -> None:
        """The engine failed this request: log it, end the RPC with INTERNAL, or with
        UNAVAILABLE when the whole engine failed (the server is going away: retry elsewhere)."""
        error = getattr(delta, "error", "") or "a fault in the engine step was pinned on it"
        log_event("request.failed", logging.ERROR, request_id=request_id,
                  completion_tokens=delta.num_output_tokens, error=error)
        if not self.core.healthy:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"request {request_id} failed: {error}; "
                                "the server is stopping, retry on another replica")
        await context.abort(grpc.StatusCode.INTERNAL, f"request {request_id} failed in the engine after "
                            f"{delta.num_output_tokens} tokens ({error}); the server keeps serving")

    def _finished(self, request_id: str, timing: RequestTiming, reason: str) -> None:
        now = time.monotonic()
        self.metrics.request_finished(timing, reason, now)
        ttft = None if timing.first_token is None else round(timing.first_token - timing.accepted, 4)
        log_event("request.finished", request_id=request_id, finish_reason=reason,
                  prompt_tokens=timing.prompt_tokens, completion_tokens=timing.output_tokens,
                  ttft_s=ttft, e2e_s=round(now - timing.accepted, 4))

    async def _accept(self, request: pb.GenerateRequest | Unparsed,
                      context: grpc.aio.ServicerContext) -> EngineRequest:
        try:
            if isinstance(request, Unparsed):
                raise request.error
            return to_engine_request(request, self.tokenizer, vocab_size=self.vocab_size,
                                     max_model_len=self.max_model_len, limits=self.limits)
        except InvalidRequest as err:
            unparsed = isinstance(request, Unparsed)
            rid = "" if unparsed else request.request_id[:self.limits.max_request_id_chars]
            reason = "unparsed" if unparsed else "invalid"
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(err), rid, reason,
                               field=err.field)
            raise AssertionError("unreachable") from err  # context.abort raised

    async def _submit(self, req: EngineRequest, context: grpc.aio.ServicerContext) -> RequestStream:
        try:
            return await self.client.submit(req)
        except QueueFull as err:
            code, details, reason = grpc.StatusCode.RESOURCE_EXHAUSTED, f"server busy: {err}; retry later", \
                "queue_full"
        except EngineStopped as err:
            code, details, reason = grpc.StatusCode.UNAVAILABLE, str(err), "shutting_down"
        except ValueError as err:  # the engine's own checks (they name the field)
            already = "already" in str(err) and "request_id" in str(err)
            code = grpc.StatusCode.ALREADY_EXISTS if already else grpc.StatusCode.INVALID_ARGUMENT
            details, reason = str(err), "duplicate_id" if already else "invalid"
        await self._reject(context, code, details, req.request_id, reason)
        raise AssertionError("unreachable")

    async def _reject(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str,
                      request_id: str, reason: str, **fields: object) -> None:
        self.metrics.rejected.labels(code.name, reason).inc()
        log_event("request.rejected", logging.WARNING, request_id=request_id or None, code=code.name,
                  reason=reason, details=details, peer=context.peer(), **fields)
        await context.abort(code, details)

    # -- unary calls -------------------------------------------------------------------

    async def Tokenize(self, request: pb.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        await self._check_unary(request, context, "Tokenize")
        add_bos = request.add_bos if request.HasField("add_bos") else True
        return pb.TokenizeResponse(token_ids=self.tokenizer.encode(request.text, add_bos=add_bos))

    async def Detokenize(self, request: pb.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> pb.DetokenizeResponse:
        await self._check_unary(request, context, "Detokenize")
        if (bad := outside_vocab(request.token_ids, self.vocab_size)) is not None:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, f"token_ids: {bad}", "", "invalid",
                               method="Detokenize")
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return pb.DetokenizeResponse(text=self.tokenizer.decode(list(request.token_ids),
                                                                skip_special_tokens=skip))

    async def _check_unary(self, request, context: grpc.aio.ServicerContext, method: str,
                           needs_tokenizer: bool = True) -> None:
        """Refuse (counted, logged) a unary call whose body did not parse or has unknown fields."""
        try:
            if isinstance(request, Unparsed):
                raise request.error
            check_known(request)
        except InvalidRequest as err:
            reason = "unparsed" if isinstance(request, Unparsed) else "invalid"
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(err), "", reason, method=method)
        if needs_tokenizer and self.tokenizer is None:
            await self._reject(context, grpc.StatusCode.FAILED_PRECONDITION, "this model has no tokenizer",
                               "", "no_tokenizer", method=method)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        await self._check_unary(request, context, "GetModelInfo", needs_tokenizer=False)
        engine = self.core.engine
        cfg, sc = engine.model_config, engine.plan.scheduler
        info = pb.ModelInfo(
            model=self.model_name, architecture=cfg.architecture, vocab_size=cfg.vocab_size,
            max_model_len=sc.max_model_len, dtype=engine.config.dtype, page_size=sc.page_size,
            max_num_seqs=sc.max_num_seqs, kv_cache_bytes=engine.plan.kv_bytes,
            state_bytes_per_slot=engine.plan.slot_bytes, eos_token_ids=cfg.eos_token_ids,
            bos_token_id=cfg.bos_token_id, weight_bytes=sum(engine.weight_bytes_by_dtype.values()),
            weight_bytes_by_dtype=engine.weight_bytes_by_dtype, quantization=engine.quantization or "",
            kv_cache_dtype=engine.kv_cache_dtype)
        for spec in cfg.layers:
            info.layers.add(kind=spec.kind.value, window=spec.window)
        for group in sc.groups:
            layers = sum(1 for s in cfg.layers if s.kind.has_attention and s.window == group.window)
            info.kv_groups.add(window=group.window, num_layers=layers, num_pages=group.num_pages - 1)
        if cfg.mamba2 is not None:
            info.ssm_state_size, info.ssm_num_heads = cfg.mamba2.state_size, cfg.mamba2.num_heads
            info.ssm_head_dim = cfg.mamba2.head_dim
        elif cfg.mamba1 is not None:  # per-channel state: no heads (d_inner channels of n)
            info.ssm_state_size = cfg.mamba1.state_size
        if cfg.rglru is not None:
            info.rglru_width = cfg.rglru.width
        if sc.prefix_caching:
            stats = await self.client.stats()  # takes the core's lock: off the loop
            info.prefix_caching, info.prefix_state_stride = True, sc.prefix_state_stride
            info.prefix_state_checkpoints = stats["prefix_state_checkpoints_total"]
            info.prefix_state_checkpoint_bytes = stats["prefix_state_checkpoint_bytes"]
            info.prefix_state_checkpoints_in_use = stats["prefix_state_checkpoints_in_use"]
            info.prefix_cache_hit_tokens = stats["prefix_cache_hit_tokens"]
            info.prefix_cache_query_tokens = stats["prefix_cache_query_tokens"]
            info.prefix_state_checkpoint_evictions = stats["prefix_state_checkpoint_evictions"]
            info.prefix_cache_page_evictions = sum(stats["prefix_cache_page_evictions"].values())
        return info


def _response(delta: RequestDelta, num_top: int | None) -> pb.GenerateResponse:
    """One stream message; the engine's {token: logprob} entries (sampled + top) are split."""
    msg = pb.GenerateResponse(request_id=delta.request_id, token_ids=delta.token_ids, text=delta.text)
    for tok, entry in zip(delta.token_ids, delta.logprobs or [], strict=False):
        top = sorted(entry.items(), key=lambda x: -x[1])[:num_top or 0]
        msg.logprobs.add(token_id=tok, logprob=entry[tok],
                         top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in top])
    if delta.finished:
        msg.finish_reason = FINISH_REASONS.get(delta.finish_reason or "", pb.FINISH_REASON_UNSPECIFIED)
        msg.usage.prompt_tokens = delta.num_prompt_tokens
        msg.usage.completion_tokens = delta.num_output_tokens
    return msg


def _deadline_passed(context: grpc.aio.ServicerContext) -> bool:
    remaining = context.time_remaining()
    return remaining is not None and remaining <= 0
