"""POST /v1/chat/completions: messages rendered by the model's chat template, n choices.

The messages are rendered by `ChatTemplate` with the server's
--default-chat-template-kwargs under the request's `chat_template_kwargs`, and the
text is tokenized as it stands (no BOS added: the template writes its own), as
transformers' `apply_chat_template(messages, add_generation_prompt=True,
tokenize=True)` does. `max_completion_tokens` (or the older `max_tokens`) bounds the
output; unset, the rest of max_model_len. Streams are OpenAI's
`chat.completion.chunk`s: a role chunk per choice, content chunks, the last with
`finish_reason`, a usage chunk when `stream_options.include_usage`, then
`data: [DONE]`. This module knows nothing of the transport.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable

from serving.engine.outputs import RequestDelta
from serving.entrypoints.openai.chat_template import NO_TEMPLATE, TemplateError
from serving.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    TokenLogprob,
    TopLogprob,
)
from serving.entrypoints.openai.serving_common import (
    ApiError,
    Call,
    Front,
    Names,
    choice_seed,
    collect,
    engine_request,
    failure,
    new_id,
)
from serving.entrypoints.openai.serving_completion import DONE, error_event, sse


def chat_prompt(front: Front, body, *, add_generation_prompt: bool = True,
                add_bos: bool = False) -> list[int]:
    """The prompt's token ids (`body`: a chat request, or /tokenize's chat form), rendered
    and tokenized; ApiError 400 when that fails."""
    if front.chat_template is None:
        raise ApiError(400, NO_TEMPLATE, "messages", "no_chat_template")
    if front.tokenizer is None:
        raise ApiError(400, "this model has no tokenizer; use /v1/completions with token ids", "messages",
                       "no_tokenizer")
    kwargs = {**front.default_chat_template_kwargs, **(body.chat_template_kwargs or {})}
    messages = [m.for_template() for m in body.messages]
    try:
        text = front.chat_template.render(messages, kwargs, add_generation_prompt=add_generation_prompt)
    except TemplateError as err:
        param = "chat_template_kwargs" if str(err).startswith("chat_template_kwargs") else "messages"
        raise ApiError(400, str(err), param) from err
    return front.tokenizer.encode(text, add_bos=add_bos)


def _check_unsupported(body: ChatCompletionRequest) -> None:
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs: needs logprobs: true", "top_logprobs")


async def create_chat_completion(front: Front, body: ChatCompletionRequest,
                                 gone: Callable[[], Awaitable[bool]]
                                 ) -> ChatCompletionResponse | AsyncIterator[str] | None:
    """The response (or an SSE stream of str, or None once the client is gone); ApiError to refuse."""
    front.check_model(body.model)
    _check_unsupported(body)
    ids = chat_prompt(front, body)
    given = body.max_completion_tokens is not None
    max_tokens = body.max_completion_tokens if given else body.max_tokens
    room = front.max_model_len - len(ids)
    if max_tokens is None and room >= 1:
        max_tokens = room
    names = Names("messages", "max_completion_tokens" if given else "max_tokens", "top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    rid = new_id("chatcmpl")
    reqs = [engine_request(ids, body, request_id=f"{rid}-{j}", seed=choice_seed(body.seed, j),
                           max_tokens=max_tokens, logprobs=logprobs, names=names, index=None,
                           **front.request_kwargs()) for j in range(body.n)]
    call = Call(front.client, front.metrics, "chat", reqs)
    await call.submit()
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return _stream(front, call, rid, logprobs, [len(ids)], usage)
    texts, lps = [""] * body.n, [ChatLogprobs() if logprobs is not None else None for _ in range(body.n)]
    reasons: list[str | None] = [None] * body.n

    def add(i: int, delta: RequestDelta) -> None:
        texts[i] += delta.text
        if lps[i] is not None:
            lps[i].content += _logprobs(front, delta, logprobs)
        if delta.finished:
            reasons[i] = delta.finish_reason

    if not await collect(front, call, gone, add):
        return None
    choices = [ChatChoice(index=i, message=ChatResponseMessage(content=texts[i]), logprobs=lps[i],
                          finish_reason=reasons[i]) for i in range(body.n)]
    return ChatCompletionResponse(id=rid, model=front.model_name, choices=choices,
                                  usage=call.usage([len(ids)]))


def _logprobs(front: Front, delta: RequestDelta, k: int) -> list[TokenLogprob]:
    out = []
    for tok, entry in zip(delta.token_ids, delta.logprobs or [], strict=False):
        text = front.token_text(tok)
        top = sorted(entry.items(), key=lambda x: -x[1])[:k]
        out.append(TokenLogprob(token=text, logprob=entry[tok], bytes=list(text.encode()), top_logprobs=[
            TopLogprob(token=(t := front.token_text(i)), logprob=v, bytes=list(t.encode())) for i, v in top]))
    return out


async def _stream(front: Front, call: Call, rid: str, logprobs: int | None, prompt_lens: list[int],
                  include_usage: bool) -> AsyncIterator[str]:
    """SSE events until every choice finished; a disconnect cancels this and aborts the rest."""
    created = int(time.time())

    def chunk(choices: list[ChatChunkChoice], usage=None) -> str:
        return sse(ChatCompletionChunk(id=rid, created=created, model=front.model_name, choices=choices,
                                       usage=usage))

    watch = front.client.watch(call.streams)
    try:
        for i in range(len(call.requests)):
            yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
        while not watch.done:
            for i, delta in await watch.next():
                call.record(i, delta)
                if (err := failure(delta)) is not None:
                    watch.close()
                    call.finish()
                    yield error_event(err)
                    yield DONE
                    return
                lp = ChatLogprobs(content=_logprobs(front, delta, logprobs)) \
                    if logprobs is not None and delta.token_ids else None
                if not delta.text and lp is None and not delta.finished:
                    continue
                yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(content=delta.text), logprobs=lp,
                                             finish_reason=delta.finish_reason if delta.finished else None)])
        if include_usage:
            yield chunk([], call.usage(prompt_lens))
        watch.close()
        call.finish()
        yield DONE
    finally:
        watch.close()
        call.finish()
