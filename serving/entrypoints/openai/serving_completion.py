"""POST /v1/completions: prompts (text, token ids, or lists of either) x n choices.

A text prompt is tokenized with the BOS that the Python API and gRPC add; token
ids are used as given. Choice k of prompt p has index p * n + k (as vLLM). `echo`
puts the prompt's text before the choice's text (not with `logprobs`: the engine
computes no prompt log-probabilities). `return_token_ids` (vLLM's extension) adds
each choice's prompt and generated token ids; in a stream every chunk carries its own
ids, so a token that decodes to no text yet still gets a chunk. Streams are OpenAI's `text_completion`
chunks, one choice each, then a usage chunk when `stream_options.include_usage`,
then `data: [DONE]`. This module knows nothing of the transport.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from serving.engine.outputs import RequestDelta
from serving.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
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

DONE = "data: [DONE]\n\n"
MAX_CHOICES = 1024  # prompts x n of one request (each is an engine request, checked on the event loop)


def sse(model) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def error_event(err: ApiError) -> str:
    return f"data: {json.dumps(err.body())}\n\n"


def _prompts(prompt) -> list[str | list[int]]:
    """The request's prompts: one string or id list, or a list of them."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], int):
        return [prompt]
    if not prompt:
        raise ApiError(400, "prompt: the prompt list is empty", "prompt")
    return list(prompt)


def _check_unsupported(body: CompletionRequest) -> None:
    if body.best_of is not None and body.best_of != body.n:
        raise ApiError(400, f"best_of: only best_of == n ({body.n}) is served", "best_of")
    if body.suffix is not None:
        raise ApiError(400, "suffix: insertion (suffix) is not served", "suffix")
    if body.echo and body.logprobs is not None:
        raise ApiError(400, "echo: echo with logprobs needs prompt log-probabilities, which this server "
                       "does not compute", "echo")


async def create_completion(front: Front, body: CompletionRequest, gone: Callable[[], Awaitable[bool]]
                            ) -> CompletionResponse | AsyncIterator[str] | None:
    """The response (or an SSE stream of str, or None once the client is gone); ApiError to refuse."""
    front.check_model(body.model)
    _check_unsupported(body)
    prompts = _prompts(body.prompt)
    rid, n = new_id("cmpl"), body.n
    if len(prompts) * n > MAX_CHOICES:
        raise ApiError(400, f"prompt: {len(prompts)} prompts x n={n} choices; at most {MAX_CHOICES} per "
                       "request", "prompt")
    names = Names("prompt")
    reqs = [engine_request(p, body, request_id=f"{rid}-{i}-{j}", seed=choice_seed(body.seed, j),
                           max_tokens=body.max_tokens, logprobs=body.logprobs, names=names,
                           index=i if len(prompts) > 1 else None, **front.request_kwargs())
            for i, p in enumerate(prompts) for j in range(n)]
    echo = [_echo_text(front, p, reqs[i * n].prompt_token_ids) for i, p in enumerate(prompts)] \
        if body.echo else None
    call = Call(front.client, front.metrics, "completions", reqs)
    await call.submit()
    prompt_lens = [len(reqs[i * n].prompt_token_ids) for i in range(len(prompts))]
    out = _Output(front, rid, body, n, echo,
                  [list(r.prompt_token_ids) for r in reqs] if body.return_token_ids else None)
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return _stream(front, call, out, prompt_lens, usage)
    if not await collect(front, call, gone, out.add):
        return None
    ids = body.return_token_ids
    choices = [CompletionChoice(index=i, text=out.texts[i], logprobs=out.logprobs[i],
                                finish_reason=out.reasons[i],
                                prompt_token_ids=list(reqs[i].prompt_token_ids) if ids else None,
                                token_ids=out.ids[i] if ids else None) for i in range(len(reqs))]
    return CompletionResponse(id=rid, model=front.model_name, choices=choices, usage=call.usage(prompt_lens))


def _echo_text(front: Front, prompt: str | list[int], ids: list[int]) -> str:
    if isinstance(prompt, str):
        return prompt
    return front.tokenizer.decode(ids) if front.tokenizer is not None else ""


class _Output:
    """The choices' text, log-probabilities and finish reasons, as deltas arrive."""

    def __init__(self, front: Front, rid: str, body: CompletionRequest, n: int, echo: list[str] | None,
                 prompt_ids: list[list[int]] | None = None):
        self.front, self.rid, self.k = front, rid, body.logprobs
        self.prompt_ids = prompt_ids  # per choice, with return_token_ids
        self.ids: list[list[int]] = [[] for _ in range(len(_prompts(body.prompt)) * n)]
        total = len(_prompts(body.prompt)) * n
        self.echo = [echo[i // n] for i in range(total)] if echo else None
        self.texts = list(self.echo) if self.echo else [""] * total
        self.logprobs = [CompletionLogprobs() if self.k is not None else None for _ in range(total)]
        self.offsets = [len(t) for t in self.texts]
        self.reasons: list[str | None] = [None] * total
        self.created = int(time.time())

    def add(self, i: int, delta: RequestDelta) -> None:
        self.texts[i] += delta.text
        self.ids[i] += delta.token_ids
        if self.logprobs[i] is not None:
            self.offsets[i] = _add_logprobs(self.front, delta, self.k, self.logprobs[i], self.offsets[i])
        if delta.finished:
            self.reasons[i] = delta.finish_reason

    def chunk(self, i: int, delta: RequestDelta, first: bool) -> CompletionResponse | None:
        """The stream chunk of one delta, or None when it carries nothing."""
        text = (self.echo[i] if first and self.echo else "") + delta.text
        lp = None
        if self.k is not None and delta.token_ids:
            lp = CompletionLogprobs()
            self.offsets[i] = _add_logprobs(self.front, delta, self.k, lp, self.offsets[i])
        ids = list(delta.token_ids) if self.prompt_ids is not None else None
        if not text and lp is None and not ids and not delta.finished:
            return None
        choice = CompletionChoice(index=i, text=text, logprobs=lp,
                                  finish_reason=delta.finish_reason if delta.finished else None,
                                  prompt_token_ids=self.prompt_ids[i] if first and ids is not None else None,
                                  token_ids=ids)
        return CompletionResponse(id=self.rid, created=self.created, model=self.front.model_name,
                                  choices=[choice])


def _add_logprobs(front: Front, delta: RequestDelta, k: int, lp: CompletionLogprobs, offset: int) -> int:
    """Append the delta's tokens to `lp` (the sampled token's text, log-probability, the top k
    alternatives and the sampled one, text offsets); returns the next offset."""
    for tok, entry in zip(delta.token_ids, delta.logprobs or [], strict=False):
        text = front.token_text(tok)
        top = sorted(entry.items(), key=lambda x: -x[1])[:k]
        lp.tokens.append(text)
        lp.token_logprobs.append(entry[tok])
        lp.top_logprobs.append({front.token_text(t): v for t, v in [*top, (tok, entry[tok])]})
        lp.text_offset.append(offset)
        offset += len(text)
    return offset


async def _stream(front: Front, call: Call, out: _Output, prompt_lens: list[int],
                  include_usage: bool) -> AsyncIterator[str]:
    """SSE events until every choice finished; a disconnect cancels this and aborts the rest."""
    watch = front.client.watch(call.streams)
    started = [False] * len(call.requests)
    try:
        while not watch.done:
            for i, delta in await watch.next():
                call.record(i, delta)
                if (err := failure(delta)) is not None:
                    watch.close()
                    call.finish()
                    yield error_event(err)
                    yield DONE
                    return
                chunk = out.chunk(i, delta, not started[i])
                if chunk is not None:
                    started[i] = True
                    yield sse(chunk)
        if include_usage:
            yield sse(CompletionResponse(id=out.rid, created=out.created, model=front.model_name, choices=[],
                                         usage=call.usage(prompt_lens)))
        watch.close()
        call.finish()
        yield DONE
    finally:
        watch.close()
        call.finish()
