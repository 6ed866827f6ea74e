"""A step's per-row sampling arrays, from each request's constant fields.

A request's sampling fields that never change (temperature, top-k/p, min-p, seed,
penalties, prompt length, whether it wants top-n logprobs) are one tuple made at
admission (`constant_row`). `SamplingRows.arrays` builds a step's `SamplingArrays`
column-wise from those tuples, and keeps the columns while the same sequences run in
the same order (most steps of a busy server): a step then only adds its per-row step
counters and the EOS suppression of rows still under min_tokens. This module knows
nothing of scheduling or devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from serving.core.sequence import Sequence
from serving.engine.detokenizer import IncrementalDetokenizer
from serving.sample.sampling import SUPPRESS_WIDTH, SamplingArrays
from serving.sample.sampling_params import SamplingParams

# Sampling fields that stay constant over a request's life (SamplingArrays names).
ROW = ("temperature", "top_k", "top_p", "min_p", "seed", "repetition", "presence", "frequency",
       "prompt_len", "want_top")


@dataclass
class Request:
    """What the engine keeps of a live request besides its Sequence."""

    seq: Sequence
    detok: IncrementalDetokenizer | None
    ban: list[int]  # EOS and stop ids, suppressed while fewer than min_tokens were generated
    full: bool  # needs the full sampler: logit bias, penalties, top-k/p/min-p, or top-n logprobs
    row: tuple  # the constant sampling fields (seed included), in `ROW` order


def uses_filters(p: SamplingParams) -> bool:
    """The request samples through top-k / top-p / min-p."""
    return p.temperature > 0 and (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0)


def uses_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def needs_full(p: SamplingParams) -> bool:
    return uses_filters(p) or uses_penalties(p) or bool(p.logprobs) or bool(p.logit_bias)


def constant_row(p: SamplingParams, seed: int, prompt_len: int, vocab_size: int) -> tuple:
    """The request's `ROW` tuple; `seed` already drawn when the request gave none."""
    # top_k >= the vocabulary keeps every token, as top_k off does (and fits int32).
    top_k = min(max(p.top_k, 0), vocab_size)
    return (p.temperature, top_k, p.top_p, p.min_p, seed, p.repetition_penalty, p.presence_penalty,
            p.frequency_penalty, prompt_len, bool(p.logprobs))


class _Kept(NamedTuple):
    seqs: tuple[Sequence, ...]
    cols: dict[str, np.ndarray]
    full: bool
    bans: list[tuple[int, list[int], int]]  # (row, ids to suppress, min_tokens) where min_tokens > 0


class SamplingRows:
    """Builds a step's sampling arrays; keeps the constant columns of the last step."""

    def __init__(self) -> None:
        self._kept: _Kept | None = None

    def arrays(self, seqs: tuple[Sequence, ...], requests: dict[str, Request],
               out_index: np.ndarray) -> tuple[SamplingArrays, bool]:
        """Row i samples for seqs[i], its out_index[i]-th output token. Also returns
        whether any row needs the full sampler."""
        b = len(seqs)
        if not b:
            return SamplingArrays.from_rows([]), False
        kept = self._kept
        if kept is None or kept.seqs != seqs:
            kept = self._kept = _columns(seqs, requests)
        suppress = np.full((b, SUPPRESS_WIDTH), -1, np.int32)
        for i, ban, min_tokens in kept.bans:
            if out_index[i] < min_tokens:
                suppress[i, :len(ban)] = ban
        return SamplingArrays(**kept.cols, step=out_index, suppress=suppress), kept.full


def _columns(seqs: tuple[Sequence, ...], requests: dict[str, Request]) -> _Kept:
    reqs = [requests[q.request_id] for q in seqs]
    b = len(reqs)
    const = np.array([r.row for r in reqs], np.float64).reshape(b, len(ROW))
    col = dict(zip(ROW, const.T, strict=True))
    # A float beyond float32's range becomes inf, as a float32 array built from the
    # Python value would (e.g. temperature 1e39: uniform sampling); no warning for it.
    with np.errstate(over="ignore"):
        cols = {k: col[k].astype(np.float32) for k in
                ("temperature", "top_p", "min_p", "repetition", "presence", "frequency")}
    cols |= dict(top_k=col["top_k"].astype(np.int32), seed=col["seed"].astype(np.uint32),
                 prompt_len=col["prompt_len"].astype(np.int32), want_top=col["want_top"] != 0)
    bans = [(i, r.ban, r.seq.params.min_tokens) for i, r in enumerate(reqs)
            if r.ban and r.seq.params.min_tokens > 0]
    return _Kept(seqs, cols, any(r.full for r in reqs), bans)
