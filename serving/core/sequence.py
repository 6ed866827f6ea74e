"""One request's host-side state, and the token-level stop check.

A `Sequence` holds the token ids (prompt then output), its sampling
parameters, where it stands in the engine (status, tokens already in the
cache, slot, pages per attention group) and why it finished. It knows nothing
of text, devices or scheduling policy. Stop *strings* need the detokenizer and
are checked by the engine, which then calls `Scheduler.finish`.
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from collections.abc import Sequence as SequenceABC

from serving.core.block_table import PageRing
from serving.core.pools import DUMMY_INDEX
from serving.sample.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id, or a stop string (engine)
    LENGTH = "length"  # max_tokens (or max_model_len) reached
    ABORT = "abort"  # aborted by the client or the engine
    ERROR = "error"  # the engine failed this request (a fault pinned on it); others go on


class Sequence:
    """A request as the scheduler sees it.

    Invariants kept by the scheduler:
      - `token_ids` = prompt + output; `num_computed_tokens` (n) of them have
        their K/V and state in the cache; `n < num_tokens` while not finished.
      - `slot` is 0 (the dummy) unless RUNNING; `rings[g]` holds pages only
        while RUNNING.
      - A preempted sequence goes back to WAITING with n = 0: its whole
        `token_ids` (prompt + output so far) is recomputed as a prefill, and
        its output is kept.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: SequenceABC[int],
        params: SamplingParams | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: prompt_token_ids must not be empty")
        self.request_id = request_id
        self.params = params if params is not None else SamplingParams()
        self.token_ids: list[int] = [int(t) for t in prompt_token_ids]
        self.num_prompt_tokens = len(self.token_ids)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.slot = DUMMY_INDEX
        self.rings: tuple[PageRing, ...] = ()
        self.arrival = -1  # set by Scheduler.add; FCFS order and preemption priority
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string
        self.num_preemptions = 0
        # Tokens sampled by a dispatched step whose values have not reached the host yet
        # (the overlapped loop): they follow `token_ids` and count as known for scheduling.
        self.num_pending = 0
        # Token ids that can stop it (EOS unless ignore_eos, stop_token_ids); set by
        # Scheduler.add, which knows the EOS ids.
        self.stop_ids: frozenset[int] = frozenset()
        # Prefix caching: chain hashes of the full pages of `token_ids` computed so far.
        self.page_keys: list[bytes] = []

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens}, "
            f"slot={self.slot})"
        )

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens (known or pending) still to run through the model before the next sample."""
        return len(self.token_ids) + self.num_pending - self.num_computed_tokens

    @property
    def is_exhausted(self) -> bool:
        """Its pending tokens already reach max_tokens: nothing more may be scheduled."""
        return self.num_pending > 0 and self.num_output_tokens + self.num_pending >= self.params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(int(token_id))


def check_stop(seq: Sequence, eos_token_ids: Collection[int]) -> FinishReason | None:
    """Whether `seq` stops on its last output token; sets `seq.stop_reason` when it does.

    Order (a natural stop wins over the length limit when both hold):
      1. before `min_tokens` outputs, EOS and stop_token_ids do not stop;
      2. an EOS id (unless `ignore_eos`) -> STOP (stop_reason None);
      3. a stop token id -> STOP (stop_reason = that id);
      4. `max_tokens` outputs -> LENGTH.
    The stopping token stays in the output; hiding it from text is the engine's call.
    """
    params = seq.params
    num_out = seq.num_output_tokens
    if num_out == 0:
        return None
    if num_out >= params.min_tokens:
        last = seq.token_ids[-1]
        if not params.ignore_eos and last in eos_token_ids:
            seq.stop_reason = None
            return FinishReason.STOP
        if last in params.stop_token_ids:
            seq.stop_reason = last
            return FinishReason.STOP
    if num_out >= params.max_tokens:
        return FinishReason.LENGTH
    return None
