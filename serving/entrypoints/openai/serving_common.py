"""What the completions and chat handlers share: errors, engine requests, submission, metrics.

Requests are checked by the same code as gRPC: each prompt x choice becomes a
`GenerateRequest` message that `serving.entrypoints.validation.to_engine_request` checks
(prompt, vocabulary, max_model_len, sampling values through `SamplingParams`, the
limits of `RequestLimits`), and its errors, which name the proto field, are
renamed to the OpenAI parameter (`params.top_p` -> `top_p`, `text` -> `prompt` or
`messages`). `ApiError` carries an HTTP status and OpenAI's error body. This module
knows nothing of the transport (see `api_server`).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from pydantic import ValidationError

from serving.engine.engine_core import EngineStopped, QueueFull, RequestStream
from serving.engine.outputs import RequestDelta
from serving.entrypoints.async_engine import AsyncEngineClient
from serving.entrypoints.metrics import RequestTiming, ServerMetrics
from serving.entrypoints.openai.protocol import SamplingRequest, Usage
from serving.entrypoints.request_log import log_event
from serving.entrypoints.validation import EngineRequest, InvalidRequest, RequestLimits, to_engine_request
from serving.proto.hybrid_jax.v1 import generation_pb2 as pb

# HTTP status -> (OpenAI error type, the gRPC code name the metrics count it under)
ERRORS = {400: ("invalid_request_error", "INVALID_ARGUMENT"),
          401: ("authentication_error", "UNAUTHENTICATED"),
          404: ("invalid_request_error", "NOT_FOUND"), 405: ("invalid_request_error", "UNIMPLEMENTED"),
          409: ("invalid_request_error", "FAILED_PRECONDITION"),
          413: ("invalid_request_error", "INVALID_ARGUMENT"),
          429: ("rate_limit_error", "RESOURCE_EXHAUSTED"), 500: ("server_error", "INTERNAL"),
          503: ("service_unavailable_error", "UNAVAILABLE")}
_SCALARS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
            "frequency_penalty", "min_tokens", "ignore_eos")


class ApiError(Exception):
    """A refusal: HTTP `status` with OpenAI's body naming `param`; `reason` labels the metric."""

    def __init__(self, status: int, message: str, param: str | None = None, reason: str = "invalid"):
        super().__init__(message)
        self.status, self.message, self.param, self.reason = status, message, param, reason

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERRORS.get(self.status, ERRORS[500])[0],
                          "param": self.param, "code": self.status}}


def from_validation(err: ValidationError) -> ApiError:
    """The first pydantic error as a 400 naming the field path (`messages[0].content`)."""
    first = err.errors(include_url=False)[0]
    param = ""
    for part in first["loc"]:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part.isidentifier() and part not in ("str", "int", "float", "bool"):  # not union branches
            param += f".{part}" if param else part
    what = first["msg"]
    if first["type"] == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', what)}",
                        None, "unparsed")
    if first["type"] == "extra_forbidden":
        what = "unknown field: this server does not take it"
    return ApiError(400, f"{param or 'body'}: {what}", param or None, "unparsed")


@dataclass
class Names:
    """The OpenAI parameter names of one endpoint for the proto fields validation reports."""

    prompt: str  # "prompt" or "messages"
    max_tokens: str = "max_tokens"
    logprobs: str = "logprobs"

    def param(self, field: str, index: int | None) -> str:
        if field in ("text", "token_ids", "prompt"):
            return self.prompt if index is None else f"{self.prompt}[{index}]"
        name = field.removeprefix("params.")
        return {"max_tokens": self.max_tokens, "logprobs": self.logprobs}.get(name, name)


def engine_request(prompt: str | list[int], body: SamplingRequest, *, request_id: str, seed: int | None,
                   max_tokens: int | None, logprobs: int | None, names: Names, index: int | None,
                   tokenizer, vocab_size: int, max_model_len: int, limits: RequestLimits) -> EngineRequest:
    """One engine request checked as gRPC checks it; ApiError 400 names the OpenAI parameter."""
    values = {k: v for k in _SCALARS if (v := getattr(body, k)) is not None}
    for k, v in (("seed", seed), ("max_tokens", max_tokens), ("logprobs", logprobs)):
        if v is not None:
            values[k] = v
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    params = pb.SamplingParameters(stop=stop, stop_token_ids=body.stop_token_ids or [],
                                   logit_bias=_logit_bias(body.logit_bias), **values)
    msg = pb.GenerateRequest(request_id=request_id, params=params)
    if isinstance(prompt, str):
        msg.text = prompt
    else:
        msg.token_ids.ids.extend(prompt)
        if not prompt:
            msg.token_ids.SetInParent()  # an empty list is "empty", not "missing"
    try:
        return to_engine_request(msg, tokenizer, vocab_size=vocab_size, max_model_len=max_model_len,
                                 limits=limits)
    except InvalidRequest as err:
        param = names.param(err.field, index)
        message = str(err).split(": ", 1)[-1]
        raise ApiError(400, f"{param}: {message}", param) from err


def _logit_bias(raw: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias (token ids as JSON object keys) as {id: bias}; the values are
    checked with the rest of the parameters (SamplingParams)."""
    out: dict[int, float] = {}
    for key, value in (raw or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise ApiError(400, f"logit_bias: key {key!r} is not a token id", "logit_bias") from None
        if not 0 <= token < 2**31:
            raise ApiError(400, f"logit_bias: token id {key} outside [0, 2**31)", "logit_bias")
        out[token] = value
    return out


def choice_seed(seed: int | None, j: int) -> int | None:
    """Choice j's seed: the request's for the first, then seed + j (mod 2**32, the engine's
    sampling seed) so that n > 1 choices differ yet repeat with the seed."""
    if seed is None or j == 0:
        return seed
    return (seed + j) % 2**32


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


@dataclass
class Call:
    """The engine requests of one HTTP call, with their timings; counts them in the metrics."""

    client: AsyncEngineClient
    metrics: ServerMetrics
    endpoint: str
    requests: list[EngineRequest]
    streams: list[RequestStream] = field(default_factory=list)
    timings: list[RequestTiming] = field(default_factory=list)
    reasons: list[str | None] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)  # output tokens, final when finished
    finished: bool = False

    async def submit(self) -> None:
        """Queue every request, or none: on a refusal the queued ones are aborted (ApiError)."""
        for req in self.requests:
            try:
                self.streams.append(await self.client.submit(req))
            except QueueFull as err:
                self._undo()
                raise ApiError(429, f"server busy: {err}; retry later", None, "queue_full") from err
            except EngineStopped as err:
                self._undo()
                raise ApiError(503, str(err), None, "shutting_down") from err
            except ValueError as err:  # the engine's own checks ("stop_token_ids: ...")
                self._undo()
                param = str(err).split(":", 1)[0].split("=", 1)[0].strip()
                raise ApiError(400, str(err), param if param.isidentifier() else None) from err
        now = time.monotonic()
        for req in self.requests:
            timing = RequestTiming(now, len(req.prompt_token_ids))
            self.timings.append(timing)
            self.reasons.append(None)
            self.outputs.append(0)
            self.metrics.request_accepted(timing)
            log_event("request.accepted", request_id=req.request_id, endpoint=self.endpoint,
                      prompt_tokens=timing.prompt_tokens, max_tokens=req.params.max_tokens)

    def _undo(self) -> None:
        self.client.abort_soon([s.request_id for s in self.streams])
        self.streams.clear()

    def record(self, i: int, delta: RequestDelta) -> None:
        n = len(delta.token_ids)
        self.timings[i].tokens(n, time.monotonic())
        self.metrics.generation_tokens.inc(n)
        self.outputs[i] = max(self.outputs[i] + n, delta.num_output_tokens)
        if delta.finished:
            self.outputs[i] = delta.num_output_tokens
            self.reasons[i] = delta.finish_reason or "stop"

    def finish(self) -> None:
        """Count every request once: its finish reason, or "abort" when the client left.
        Idempotent; a stream calls it before its last event, so that a client that has
        seen the end finds the requests counted (as a gRPC status follows the servicer)."""
        if self.finished:
            return
        self.finished = True
        now = time.monotonic()
        for req, timing, reason in zip(self.requests, self.timings, self.reasons, strict=False):
            if reason is None:
                log_event("request.cancelled", request_id=req.request_id,
                          completion_tokens=timing.output_tokens)
            self.metrics.request_finished(timing, reason or "abort", now)
            log_event("request.finished", request_id=req.request_id, finish_reason=reason or "abort",
                      prompt_tokens=timing.prompt_tokens, completion_tokens=timing.output_tokens,
                      e2e_s=round(now - timing.accepted, 4))

    def usage(self, prompt_lens: list[int]) -> Usage:
        """OpenAI's usage: each prompt counted once (not once per choice), every choice's output."""
        prompt = sum(prompt_lens)
        completion = sum(self.outputs)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


@dataclass
class Front:
    """What every handler needs: the engine, its limits and the served model's facts."""

    client: AsyncEngineClient
    metrics: ServerMetrics
    model_name: str
    tokenizer: object  # hybrid_jax.tokenizer.Tokenizer | None
    vocab_size: int
    max_model_len: int
    limits: RequestLimits
    chat_template: object = None  # chat_template.ChatTemplate | None
    default_chat_template_kwargs: dict = field(default_factory=dict)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"model: {model!r} is not served here; this server serves "
                           f"{self.model_name!r} (GET /v1/models)", "model", "unknown_model")

    def request_kwargs(self) -> dict:
        return dict(tokenizer=self.tokenizer, vocab_size=self.vocab_size, max_model_len=self.max_model_len,
                    limits=self.limits)

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def failure(delta: RequestDelta) -> ApiError | None:
    """The error a finished delta stands for: the engine failed it, or the server aborted it."""
    if delta.finish_reason == "error":
        error = getattr(delta, "error", "") or "a fault in the engine step was pinned on it"
        log_event("request.failed", logging.ERROR, request_id=delta.request_id, error=error)
        return ApiError(500, f"request {delta.request_id} failed in the engine ({error})", None, "error")
    if delta.finish_reason == "abort":
        return ApiError(503, f"request {delta.request_id} aborted after {delta.num_output_tokens} tokens: "
                        "the server is shutting down", None, "shutting_down")
    return None


async def collect(front: Front, call: Call, gone: Callable[[], Awaitable[bool]],
                  add: Callable[[int, RequestDelta], None]) -> bool:
    """Hand every delta of a call's streams to `add(choice, delta)` until all have finished
    (a non-streamed answer). False once the client is gone; ApiError for a failed request."""
    watch = front.client.watch(call.streams)
    try:
        while not watch.done:
            got = await watch.next(gone)
            if got is None:
                return False
            for i, delta in got:
                call.record(i, delta)
                if (err := failure(delta)) is not None:
                    raise err
                add(i, delta)
    finally:
        watch.close()
        call.finish()
    return True
