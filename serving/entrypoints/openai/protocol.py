"""The OpenAI API's request and response bodies, as pydantic models (the subset served here).

Requests are strict: an unknown field, a wrong type ("1" for an int, 1 for a bool) or
an int outside the wire range is refused with the field named (`Strict`), as the
gRPC front refuses unknown proto fields. Values are checked for meaning later, by
the same code as gRPC (`serving.entrypoints.validation` and `SamplingParams`). A few OpenAI
fields that change nothing here are accepted so that stock clients work (`user`,
and `best_of`, `suffix`, `response_format` only at values that ask for nothing);
`logit_bias` is served; vLLM's extras `top_k`, `min_p`, `repetition_penalty`, `ignore_eos`,
`min_tokens`, `stop_token_ids` and `chat_template_kwargs` are served, and vLLM's
/tokenize and /detokenize bodies.
This module knows nothing of the engine or of HTTP.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

INT32 = 2**31 - 1
Int32 = Annotated[int, Field(ge=-INT32 - 1, le=INT32)]
Count = Annotated[int, Field(ge=0, le=INT32)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
TokenIds = list[Int32]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingRequest(Strict):
    """What completions and chat share: the model, sampling, stopping and streaming."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    max_tokens: Count | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int32 | None = None
    min_p: float | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Count] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: Count = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # OpenAI's end-user id: accepted, unused
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    logprobs: Annotated[int, Field(ge=0, le=INT32)] | None = None
    echo: bool = False
    return_token_ids: bool = False  # vLLM's extension: the choices carry token ids
    best_of: int | None = None  # only equal to n
    suffix: str | None = None  # only absent


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    """A message; content given as text parts is joined with newlines (as vLLM does for
    templates that take a string)."""

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]
    name: str | None = None

    def for_template(self) -> dict:
        content = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        named = {"name": self.name} if self.name is not None else {}
        return {"role": self.role, "content": content, **named}


class ResponseFormat(Strict):
    type: Literal["text"]


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: Count | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None


# -- responses -------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # return_token_ids (vLLM's fields): the prompt's ids (a stream's first chunk of the
    # choice) and the generated ids (a stream: the chunk's own)
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] = Field(default_factory=list)


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    """A stream chunk's message delta; absent fields are left out, as OpenAI does."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer
    def _present(self) -> dict:
        return {k: v for k, v in (("role", self.role), ("content", self.content)) if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "hybrid-jax"
    max_model_len: int  # vLLM reports it too; load generators read it
    vocab_size: int  # token-id prompts of `hybrid-jax bench serving --backend openai`


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeCompletionRequest(Strict):
    """POST /tokenize with a prompt (vLLM's form): the ids /v1/completions would send."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # the BOS, as completions add it
    return_token_strs: bool = False


class TokenizeChatRequest(Strict):
    """POST /tokenize with messages: the ids /v1/chat/completions would send."""

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the template writes its own
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: TokenIds


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
