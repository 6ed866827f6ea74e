"""The `hybrid_jax.v1.Generation` servicer: gRPC calls onto the engine core.

Each `Generate` call runs in one thread of the gRPC pool: it checks the request
(`serving.validation`), submits it to the `EngineCore`, and forwards the request's
deltas as `GenerateResponse` messages. Status codes:

  INVALID_ARGUMENT     a bad field (named in the details); the server keeps serving
  RESOURCE_EXHAUSTED   the waiting queue is full (nothing was queued)
  ALREADY_EXISTS       the client's request_id is live
  UNAVAILABLE          the server is shutting down (before or after acceptance)
  INTERNAL             the engine step failed

A client cancel or an expired deadline ends the RPC; its callback aborts the
request in the engine at once, which frees its pages and slot. This module knows
nothing of sockets, signals or the process lifecycle (see `serving.server`).
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator

import grpc

from serving.engine_core import EngineCore, EngineStopped, QueueFull
from serving.metrics import RequestTiming, ServerMetrics
from serving.outputs import RequestDelta
from serving.proto.hybrid_jax.v1 import generation_pb2 as pb
from serving.proto.hybrid_jax.v1 import generation_pb2_grpc as pb_grpc
from serving.request_log import log_event
from serving.validation import EngineRequest, InvalidRequest, check_known, to_engine_request

FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
                  "abort": pb.FINISH_REASON_ABORT}
POLL_S = 0.1  # how often a waiting handler re-checks that its client is still there


class GenerationServicer(pb_grpc.GenerationServicer):
    """Serves one engine core; `model_name` is reported by GetModelInfo."""

    def __init__(self, core: EngineCore, metrics: ServerMetrics, *, model_name: str):
        self.core, self.metrics, self.model_name = core, metrics, model_name
        engine = core.engine
        self.tokenizer = engine.tokenizer
        self.vocab_size = engine.model_config.vocab_size
        self.max_model_len = engine.plan.scheduler.max_model_len

    # -- Generate ----------------------------------------------------------------------

    def Generate(self, request: pb.GenerateRequest,
                 context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        """Stream one request's deltas; ends with a finished message or a status (see above)."""
        req = self._accept(request, context)
        timing = RequestTiming(time.monotonic(), len(req.prompt_token_ids))
        stream = self._submit(req, context)
        self.metrics.request_accepted(timing)
        log_event("request.accepted", request_id=req.request_id, peer=context.peer(),
                  prompt_tokens=timing.prompt_tokens, max_tokens=req.params.max_tokens)
        finished = False
        context.add_callback(lambda: finished or self.core.abort(req.request_id))
        reason = "abort"
        try:
            for delta in self._deltas(stream, context):
                timing.tokens(len(delta.token_ids), time.monotonic())
                self.metrics.generation_tokens.inc(len(delta.token_ids))
                if delta.finished:
                    finished, reason = True, delta.finish_reason or "stop"
                if delta.finish_reason == "abort" and context.is_active():
                    # Not the client's doing: the server aborted it (shutdown grace ran out).
                    context.abort(grpc.StatusCode.UNAVAILABLE, f"request {req.request_id} aborted after "
                                  f"{delta.num_output_tokens} tokens: the server is shutting down")
                yield _response(delta, req.params.logprobs)
        finally:
            if not finished:  # the client went away (cancel, deadline) or the handler failed
                self.core.abort(req.request_id)
                log_event("request.cancelled", request_id=req.request_id,
                          completion_tokens=timing.output_tokens, deadline_passed=_deadline_passed(context))
            self._finished(req.request_id, timing, reason)

    def _finished(self, request_id: str, timing: RequestTiming, reason: str) -> None:
        now = time.monotonic()
        self.metrics.request_finished(timing, reason, now)
        ttft = None if timing.first_token is None else round(timing.first_token - timing.accepted, 4)
        log_event("request.finished", request_id=request_id, finish_reason=reason,
                  prompt_tokens=timing.prompt_tokens, completion_tokens=timing.output_tokens,
                  ttft_s=ttft, e2e_s=round(now - timing.accepted, 4))

    def _accept(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> EngineRequest:
        try:
            return to_engine_request(request, self.tokenizer, vocab_size=self.vocab_size,
                                     max_model_len=self.max_model_len)
        except InvalidRequest as err:
            self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(err), request.request_id,
                         field=err.field)
            raise AssertionError("unreachable") from err  # context.abort raised

    def _submit(self, req: EngineRequest, context: grpc.ServicerContext):
        try:
            return self.core.submit(params=req.params, prompt_token_ids=req.prompt_token_ids,
                                    request_id=req.request_id)
        except QueueFull as err:
            code, details = grpc.StatusCode.RESOURCE_EXHAUSTED, f"server busy: {err}; retry later"
        except EngineStopped as err:
            code, details = grpc.StatusCode.UNAVAILABLE, str(err)
        except ValueError as err:  # the engine's own checks (they name the field)
            already = "already" in str(err) and "request_id" in str(err)
            code = grpc.StatusCode.ALREADY_EXISTS if already else grpc.StatusCode.INVALID_ARGUMENT
            details = str(err)
        self._reject(context, code, details, req.request_id)
        raise AssertionError("unreachable")

    def _reject(self, context: grpc.ServicerContext, code: grpc.StatusCode, details: str,
                request_id: str, **fields: object) -> None:
        self.metrics.rejected.labels(code.name).inc()
        log_event("request.rejected", request_id=request_id or None, code=code.name,
                  details=details, **fields)
        context.abort(code, details)

    def _deltas(self, stream, context: grpc.ServicerContext) -> Iterator[RequestDelta]:
        """The request's deltas until the last, or until the client is gone."""
        while True:
            try:
                delta = stream.get(timeout=POLL_S)
            except queue.Empty:
                if not context.is_active():
                    return
                continue
            except RuntimeError as err:  # the engine step failed; the core aborted the request
                context.abort(grpc.StatusCode.INTERNAL, str(err))
            yield delta
            if delta.finished:
                return

    # -- unary calls -------------------------------------------------------------------

    def Tokenize(self, request: pb.TokenizeRequest, context: grpc.ServicerContext) -> pb.TokenizeResponse:
        self._check_unary(request, context)
        add_bos = request.add_bos if request.HasField("add_bos") else True
        return pb.TokenizeResponse(token_ids=self.tokenizer.encode(request.text, add_bos=add_bos))

    def Detokenize(self, request: pb.DetokenizeRequest,
                   context: grpc.ServicerContext) -> pb.DetokenizeResponse:
        self._check_unary(request, context)
        bad = [t for t in request.token_ids if not 0 <= t < self.vocab_size]
        if bad:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"token_ids: {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return pb.DetokenizeResponse(text=self.tokenizer.decode(list(request.token_ids),
                                                                skip_special_tokens=skip))

    def _check_unary(self, request, context: grpc.ServicerContext) -> None:
        try:
            check_known(request)
        except InvalidRequest as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        if self.tokenizer is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this model has no tokenizer")

    def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.ServicerContext) -> pb.ModelInfo:
        engine = self.core.engine
        cfg, sc = engine.model_config, engine.plan.scheduler
        info = pb.ModelInfo(
            model=self.model_name, architecture=cfg.architecture, vocab_size=cfg.vocab_size,
            max_model_len=sc.max_model_len, dtype=engine.config.dtype, page_size=sc.page_size,
            max_num_seqs=sc.max_num_seqs, kv_cache_bytes=engine.plan.kv_bytes,
            state_bytes_per_slot=engine.plan.slot_bytes, eos_token_ids=cfg.eos_token_ids,
            bos_token_id=cfg.bos_token_id)
        for spec in cfg.layers:
            info.layers.add(kind=spec.kind.value, window=spec.window)
        for group in sc.groups:
            layers = sum(1 for s in cfg.layers if s.kind.has_attention and s.window == group.window)
            info.kv_groups.add(window=group.window, num_layers=layers, num_pages=group.num_pages - 1)
        if cfg.mamba2 is not None:
            info.ssm_state_size, info.ssm_num_heads = cfg.mamba2.state_size, cfg.mamba2.num_heads
            info.ssm_head_dim = cfg.mamba2.head_dim
        if cfg.rglru is not None:
            info.rglru_width = cfg.rglru.width
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


def _deadline_passed(context: grpc.ServicerContext) -> bool:
    remaining = context.time_remaining()
    return remaining is not None and remaining <= 0
