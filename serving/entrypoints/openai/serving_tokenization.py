"""POST /tokenize and /detokenize (vLLM's bodies): the ids the completion and chat
endpoints would send to the engine, and the text of given ids.

`/tokenize` takes a prompt (`add_special_tokens`, default true: the BOS that
/v1/completions adds) or messages (rendered by the chat template as
/v1/chat/completions renders them, with the server's --default-chat-template-kwargs
under the request's; `add_generation_prompt` default true; `add_special_tokens`
default false: the template writes its own) and answers `count`, `max_model_len`,
`tokens` and, with `return_token_strs`, each token as the vocabulary spells it.
`/detokenize` decodes `tokens` with special tokens kept (as transformers' `decode`),
so that ids and text round-trip. Ids outside the vocabulary are refused (400 naming
`tokens`). This module knows nothing of the transport.
"""

from __future__ import annotations

from serving.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from serving.entrypoints.openai.serving_chat import chat_prompt
from serving.entrypoints.openai.serving_common import ApiError, Front
from serving.entrypoints.validation import outside_vocab


def _tokenizer(front: Front, param: str):
    if front.tokenizer is None:
        raise ApiError(400, "this model has no tokenizer: prompts are token ids", param, "no_tokenizer")
    return front.tokenizer


def tokenize(front: Front, body: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
    front.check_model(body.model)
    if isinstance(body, TokenizeChatRequest):
        ids = chat_prompt(front, body, add_generation_prompt=body.add_generation_prompt,
                          add_bos=body.add_special_tokens)
    else:
        ids = _tokenizer(front, "prompt").encode(body.prompt, add_bos=body.add_special_tokens)
    strs = front.tokenizer.token_strs(ids) if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=front.max_model_len, tokens=ids, token_strs=strs)


def detokenize(front: Front, body: DetokenizeRequest) -> DetokenizeResponse:
    front.check_model(body.model)
    tok = _tokenizer(front, "tokens")
    if (bad := outside_vocab(body.tokens, front.vocab_size)) is not None:
        raise ApiError(400, f"tokens: {bad}", "tokens")
    return DetokenizeResponse(prompt=tok.decode(list(body.tokens), skip_special_tokens=False))
