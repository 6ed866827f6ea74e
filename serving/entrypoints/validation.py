"""Turn wire requests (`hybrid_jax.v1` messages) into engine requests, or name what is wrong.

`to_engine_request` checks a `GenerateRequest` at the server's boundary: unknown
fields (sent by a client built from a newer proto), the prompt (present, non-empty,
inside the vocabulary, shorter than max_model_len) and the sampling parameters
(through `SamplingParams`, whose ValueErrors name the field) and the size limits
of `RequestLimits` (stop strings, stop ids, request id, bytes on the wire). Every
failure is an `InvalidRequest` whose `field` is the proto field path, so the server
can answer INVALID_ARGUMENT naming it; `parse` turns bytes that do not parse
(garbage, invalid UTF-8 in a string field, too many bytes) into an `InvalidRequest`
too, instead of grpc's unrecorded INTERNAL. This module knows nothing of gRPC status
codes, the engine loop or metrics; it only needs the tokenizer and the limits.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet

from hybrid_jax.tokenizer import Tokenizer
from serving.proto.hybrid_jax.v1 import generation_pb2 as pb
from serving.sample.sampling_params import SamplingParams, outside_vocab

DEFAULT_MAX_TOKENS = SamplingParams().max_tokens
_SCALARS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
            "frequency_penalty", "seed", "max_tokens", "min_tokens", "ignore_eos", "logprobs")


class InvalidRequest(ValueError):
    """A request the server refuses; `field` is the offending proto field path."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def default_request_bytes(max_model_len: int) -> int:
    """1 MiB + 8 bytes per token: a max_model_len prompt fits as token ids (<= 5 bytes
    each on the wire) or as text of a few bytes per token, with room for the rest."""
    return (1 << 20) + 8 * max_model_len


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask beyond its sampling values (each limit >= 1)."""

    max_request_bytes: int = 1 << 20  # serialized size of any request message
    max_stop_strings: int = 16
    max_stop_chars: int = 256  # characters of one stop string
    max_stop_token_ids: int = 64
    max_request_id_chars: int = 128

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")


class Unparsed:
    """A request body that did not parse: carried to the handler, which refuses it."""

    def __init__(self, error: InvalidRequest):
        self.error = error


def parse(message_type: type[Message], data: bytes, max_bytes: int) -> Message | Unparsed:
    """`message_type` from wire bytes, or an `Unparsed` naming why not (never raises).

    Used as the gRPC request deserializer: grpc answers a deserializer's exception with
    INTERNAL and no record, so the failure travels to the handler instead.
    """
    name = message_type.DESCRIPTOR.name
    if len(data) > max_bytes:
        return Unparsed(InvalidRequest("request", f"{len(data)} bytes exceeds the limit of "
                                       f"{max_bytes} bytes (--max-request-bytes)"))
    try:
        return message_type.FromString(data)
    except DecodeError as err:  # corrupt wire format, invalid UTF-8 in a string field, ...
        return Unparsed(InvalidRequest("request", f"the body is not a valid {name}: {err}"))


@dataclass(frozen=True)
class EngineRequest:
    """A checked request, ready for `EngineCore.submit`."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


def unknown_fields(message: Message, path: str = "") -> list[str]:
    """Paths of every unknown field in `message` and its set sub-messages ("params.#40").

    Unknown fields have no name on this side of the wire, only a number, so they are
    reported as `<parent path>#<field number>`.
    """
    prefix = f"{path}." if path else ""
    found = [f"{prefix}#{f.field_number}" for f in UnknownFieldSet(message)]
    for desc, value in message.ListFields():
        if desc.message_type is None or desc.message_type.GetOptions().map_entry:
            continue  # scalars, and maps of scalars (logit_bias)
        children = value if desc.is_repeated else [value]
        for i, child in enumerate(children):
            sub = f"{prefix}{desc.name}" + (f"[{i}]" if desc.is_repeated else "")
            found += unknown_fields(child, sub)
    return found


def check_known(message: Message) -> None:
    """InvalidRequest naming the first unknown field, if any."""
    unknown = unknown_fields(message)
    if unknown:
        raise InvalidRequest(unknown[0], f"unknown field(s) {unknown}; this server's "
                             f"{message.DESCRIPTOR.full_name} does not define them")


def prompt_ids(req: pb.GenerateRequest, tokenizer: Tokenizer | None, *, vocab_size: int,
               max_model_len: int) -> list[int]:
    """The prompt as token ids; InvalidRequest when missing, empty, out of vocab or too long."""
    which = req.WhichOneof("prompt")
    if which is None:
        raise InvalidRequest("prompt", "give prompt text or prompt token_ids")
    if which == "text":
        if not req.text:
            raise InvalidRequest("text", "the prompt is empty")
        if tokenizer is None:
            raise InvalidRequest("text", "this model has no tokenizer; send token_ids")
        ids = tokenizer.encode(req.text, add_bos=True)
    else:
        ids = list(req.token_ids.ids)
        if not ids:
            raise InvalidRequest("token_ids", "the prompt is empty")
        if (bad := outside_vocab(ids, vocab_size)) is not None:
            raise InvalidRequest("token_ids", bad)
    if len(ids) >= max_model_len:
        raise InvalidRequest(which, f"the prompt has {len(ids)} tokens; max_model_len={max_model_len} "
                             f"leaves room for at most {max_model_len - 1}")
    return ids


def check_limits(req: pb.GenerateRequest, limits: RequestLimits) -> None:
    """InvalidRequest when the request id, stop strings or stop ids exceed `limits`."""
    if len(req.request_id) > limits.max_request_id_chars:
        raise InvalidRequest("request_id", f"{len(req.request_id)} characters; at most "
                             f"{limits.max_request_id_chars}")
    stop, ids = req.params.stop, req.params.stop_token_ids
    if len(stop) > limits.max_stop_strings:
        raise InvalidRequest("params.stop", f"{len(stop)} stop strings; at most {limits.max_stop_strings}")
    long = [i for i, s in enumerate(stop) if len(s) > limits.max_stop_chars]
    if long:
        raise InvalidRequest(f"params.stop[{long[0]}]", f"{len(stop[long[0]])} characters; at most "
                             f"{limits.max_stop_chars}")
    if len(ids) > limits.max_stop_token_ids:
        raise InvalidRequest("params.stop_token_ids", f"{len(ids)} ids; at most {limits.max_stop_token_ids}")


def sampling_params(msg: pb.SamplingParameters, *, room: int) -> SamplingParams:
    """SamplingParams from the set fields; unset max_tokens is min(default, room)."""
    kwargs: dict[str, object] = {name: getattr(msg, name) for name in _SCALARS if msg.HasField(name)}
    kwargs.setdefault("max_tokens", min(DEFAULT_MAX_TOKENS, room))
    kwargs["stop"] = tuple(msg.stop)
    kwargs["stop_token_ids"] = tuple(msg.stop_token_ids)
    if msg.logit_bias:
        kwargs["logit_bias"] = dict(msg.logit_bias)
    try:
        return SamplingParams(**kwargs)
    except ValueError as err:  # SamplingParams names the field first ("top_p=0.0 must ...")
        name = str(err).split("=", 1)[0].split(":", 1)[0].strip()
        raise InvalidRequest(f"params.{name}" if name in kwargs else "params", str(err)) from err


def to_engine_request(req: pb.GenerateRequest, tokenizer: Tokenizer | None, *, vocab_size: int,
                      max_model_len: int, limits: RequestLimits | None = None) -> EngineRequest:
    """Check a GenerateRequest; InvalidRequest names the first bad field.

    prompt + max_tokens must fit max_model_len; when max_tokens is unset it is
    lowered to fit, when it is set too large the request is refused.
    """
    check_known(req)
    check_limits(req, limits or RequestLimits())
    ids = prompt_ids(req, tokenizer, vocab_size=vocab_size, max_model_len=max_model_len)
    room = max_model_len - len(ids)
    params = sampling_params(req.params, room=room)
    if params.max_tokens > room:
        raise InvalidRequest("params.max_tokens", f"{params.max_tokens} + {len(ids)} prompt tokens "
                             f"exceeds max_model_len={max_model_len}")
    try:
        params.check_vocab(vocab_size)
    except ValueError as err:  # "stop_token_ids: [...] outside the vocabulary ..."
        name, message = str(err).split(": ", 1)
        raise InvalidRequest(f"params.{name}", message) from err
    return EngineRequest(req.request_id or f"req-{uuid.uuid4().hex[:16]}", ids, params)
