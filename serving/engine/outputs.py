"""What the engine returns: streamed deltas and finished request outputs (vLLM-like)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestDelta:
    """New tokens and text of one request from one engine step; the last has finished=True."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int


@dataclass
class RequestOutput:
    """A whole request: prompt, every output token, text, finish reason and logprobs."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None
    finished: bool = False

    def add(self, delta: RequestDelta) -> None:
        self.token_ids += delta.token_ids
        self.text += delta.text
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        self.finished, self.finish_reason = delta.finished, delta.finish_reason
