"""Per-request sampling and stop parameters, validated at construction.

`SamplingParams` is plain data that the user hands to the engine with each
request. It validates itself (ValueError naming the field and its value) so
that the scheduler, the runner and the gRPC server can trust it. It knows
nothing of tokenizers, devices or the model: stop *strings* are only stored
here; matching them against detokenized text is the engine's job.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # token ids a request may bias (OpenAI's limit)
LOGIT_BIAS_RANGE = 100.0  # |bias| at most this (OpenAI's range)


def outside_vocab(ids, vocab_size: int) -> str | None:
    """The message for token ids outside [0, vocab_size) (the first five), None if all inside."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    return f"{bad[:5]} outside the vocabulary [0, {vocab_size})" if bad else None


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one request and when to stop it (vLLM-compatible meanings).

    Sampling:
      temperature: >= 0; 0 means greedy (argmax; top-k/p/min-p are then moot).
      top_k: keep the k most likely tokens; -1 or 0 turn it off (0 is stored as -1).
      top_p: nucleus mass in (0, 1]; 1 turns it off.
      min_p: in [0, 1]; drop tokens below min_p * p(most likely); 0 turns it off.
      repetition_penalty: > 0; 1 turns it off (divides positive logits of seen
        tokens, multiplies negative ones; seen = prompt + output).
      presence_penalty, frequency_penalty: in [-2, 2]; applied to output tokens.
      seed: per-request seed (any int, negative too) for reproducible sampling
        whatever the batch, or None for the engine's stream. The sampling seed is
        `seed mod 2**32` (so -1 and 2**32 - 1 sample alike).
      logprobs: None, or how many top log-probabilities (0..20) to return per
        sampled token besides the sampled token's own.
      logit_bias: {token id: bias} added to those tokens' logits before penalties
        and sampling (OpenAI's meaning): at most 300 ids, each bias in [-100, 100];
        stored as a tuple of (id, bias) pairs sorted by id. Log-probabilities stay
        the model's raw distribution, as with penalties.

    Stopping (a finish reason is reported on every output):
      max_tokens: >= 1 output tokens at most ("length").
      min_tokens: 0..max_tokens; EOS and stop_token_ids do not stop (and the
        runner should mask them) before this many output tokens.
      stop: strings that end generation when they appear in the output text
        (matched by the engine; a single str is accepted and wrapped).
      stop_token_ids: token ids that end generation ("stop"); the token is kept.
      ignore_eos: keep generating past the model's EOS ids (stop_token_ids still apply).

    Sequence fields are stored as tuples so that the object stays hashable and
    immutable; lists are accepted.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        self._check_sampling()
        self._check_stopping()

    @property
    def is_greedy(self) -> bool:
        """True when the next token is the argmax (temperature 0)."""
        return self.temperature == 0.0

    def _check_sampling(self) -> None:
        temperature, top_k, top_p, min_p = self.temperature, self.top_k, self.top_p, self.min_p
        if not _is_real(temperature) or temperature < 0:
            raise ValueError(f"{temperature=} must be a finite number >= 0 (0 = greedy)")
        if not _is_int(top_k) or (top_k < 1 and top_k not in (-1, 0)):
            raise ValueError(f"{top_k=} must be an int >= 1, or -1 / 0 to turn it off")
        if top_k == 0:
            object.__setattr__(self, "top_k", -1)
        if not _is_real(top_p) or not 0.0 < top_p <= 1.0:
            raise ValueError(f"{top_p=} must be in (0, 1]")
        if not _is_real(min_p) or not 0.0 <= min_p <= 1.0:
            raise ValueError(f"{min_p=} must be in [0, 1]")
        repetition_penalty = self.repetition_penalty
        if not _is_real(repetition_penalty) or repetition_penalty <= 0:
            raise ValueError(f"{repetition_penalty=} must be a finite number > 0 (1 = off)")
        presence_penalty, frequency_penalty = self.presence_penalty, self.frequency_penalty
        if not _is_real(presence_penalty) or not -2.0 <= presence_penalty <= 2.0:
            raise ValueError(f"{presence_penalty=} must be in [-2, 2]")
        if not _is_real(frequency_penalty) or not -2.0 <= frequency_penalty <= 2.0:
            raise ValueError(f"{frequency_penalty=} must be in [-2, 2]")
        seed = self.seed
        if seed is not None and not _is_int(seed):
            raise ValueError(f"{seed=} must be an int or None")
        logprobs = self.logprobs
        if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= MAX_LOGPROBS):
            raise ValueError(f"{logprobs=} must be None or an int in [0, {MAX_LOGPROBS}]")
        self._check_logit_bias()

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            bias = ()
        items = bias.items() if isinstance(bias, dict) else bias
        try:
            pairs = [(t, b) for t, b in items]
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias={bias!r} must map token ids to biases") from None
        if len(pairs) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias: {len(pairs)} token ids; at most {MAX_LOGIT_BIAS}")
        bad = [t for t, _ in pairs if not _is_int(t) or t < 0]
        if bad:
            raise ValueError(f"logit_bias: token ids must be ints >= 0, got {bad[:5]}")
        if len({t for t, _ in pairs}) != len(pairs):
            raise ValueError("logit_bias: a token id appears twice")
        off = [b for _, b in pairs if not _is_real(b) or abs(b) > LOGIT_BIAS_RANGE]
        if off:
            raise ValueError(f"logit_bias: biases must be numbers in [-{LOGIT_BIAS_RANGE:g}, "
                             f"{LOGIT_BIAS_RANGE:g}], got {off[:5]}")
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in pairs)))

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError naming the field when a stop id or a biased id is outside the
        model's vocabulary (which only the engine and the servers know)."""
        for name, ids in (("stop_token_ids", self.stop_token_ids),
                          ("logit_bias", [t for t, _ in self.logit_bias])):
            if (bad := outside_vocab(ids, vocab_size)) is not None:
                raise ValueError(f"{name}: {bad}")

    def _check_stopping(self) -> None:
        max_tokens, min_tokens = self.max_tokens, self.min_tokens
        if not _is_int(max_tokens) or max_tokens < 1:
            raise ValueError(f"{max_tokens=} must be an int >= 1")
        if not _is_int(min_tokens) or min_tokens < 0:
            raise ValueError(f"{min_tokens=} must be an int >= 0")
        if min_tokens > max_tokens:
            raise ValueError(f"{min_tokens=} must be <= {max_tokens=}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos={self.ignore_eos!r} must be a bool")
        stop = _as_tuple(self.stop, "stop")
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"{stop=} must be a list of non-empty strings")
        object.__setattr__(self, "stop", stop)
        stop_token_ids = _as_tuple(self.stop_token_ids, "stop_token_ids")
        if not all(_is_int(t) and t >= 0 for t in stop_token_ids):
            raise ValueError(f"{stop_token_ids=} must be a list of ints >= 0")
        object.__setattr__(self, "stop_token_ids", stop_token_ids)


def _as_tuple(value: object, name: str) -> tuple:
    """A str becomes a 1-tuple (vLLM accepts stop="###"); other iterables a tuple."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, Iterable):
        return tuple(value)
    raise ValueError(f"{name}={value!r} must be a list")
