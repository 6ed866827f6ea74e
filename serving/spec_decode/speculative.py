"""Speculative decoding: drafters, on-device acceptance, and the counters.

A verification step gives every decoding sequence q = k + 1 tokens: its last sampled
token and k drafted ones (padded when fewer were proposed; `num_drafts` says how many
are real). The target model's logits at the q positions decide, on the device and in
the same executable as the forward, how many drafts are accepted (`accept`); the
recurrent state after the last accepted position is then chosen from the per-position
candidates (hybrid_jax/ragged.py `choose`), so rejected tokens never reach a slot.

Acceptance (a draft is a point mass: both drafters propose deterministic tokens):
  - greedy rows: a draft is accepted while it equals the target's argmax; the token
    after the accepted prefix is the target's argmax there (the "bonus" token when
    every draft was accepted);
  - temperature > 0: draft d at position j is accepted with probability p_j(d), p the
    tempered target distribution; at the first rejection the token is drawn from p_j
    with d removed and renormalised ((p - q)+ for a point mass q); after k accepted
    drafts, from p_k. Every emitted token is then distributed as p (Leviathan et al.
    2023, Chen et al. 2023). Draws at the token with output index i use keys folded
    from (seed, i) only, so a seeded request is reproducible.

This module knows nothing of scheduling; `NgramDrafter` reads token lists only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from serving.sample.sampling import SamplingArrays, filter_logits

METHODS = (None, "ngram", "draft", "mtp")
MAX_SPECULATIVE_TOKENS = 8


class NgramDrafter:
    """Prompt lookup: find an earlier occurrence of the sequence's last n tokens (n from
    `max_n` down to `min_n`) and propose the k tokens that followed it: the latest
    occurrence followed by k tokens, else the earliest (the longest continuation)."""

    def __init__(self, k: int, min_n: int, max_n: int):
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose(self, tokens: list[int], k: int | None = None) -> list[int]:
        k = self.k if k is None else k
        n_tok = len(tokens)
        if k <= 0 or n_tok < 2:
            return []
        arr = np.asarray(tokens, np.int64)
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            suffix = arr[n_tok - n:]
            # Windows starting at 0 .. n_tok - n - 1 (the suffix itself excluded).
            win = np.lib.stride_tricks.sliding_window_view(arr[:n_tok - 1], n)
            hits = np.flatnonzero((win == suffix).all(axis=1))
            if hits.size:
                # The latest match followed by k tokens; else the earliest (longest run).
                full = hits[hits + n + k <= n_tok]
                start = int(full[-1] if full.size else hits[0]) + n
                return arr[start:start + k].tolist()
        return []


def accept(logits: jax.Array, tokens: jax.Array, num_drafts: jax.Array,
           sampling: SamplingArrays, *, filters: bool = True) -> tuple[jax.Array, jax.Array]:
    """Decide acceptance on the device.

    logits [b, q, v] f32 (position j predicts the token after tokens[:, j]);
    tokens [b, q] (tokens[:, 0] the last sampled token, tokens[:, 1:] the drafts);
    num_drafts [b] (drafts beyond it are padding, never accepted). Temperature, top-k,
    top-p and min-p shape the target distribution as in `serving.sample.sampling.sample`;
    penalties, suppression and logprobs are not supported here (such rows are not verified).
    Returns (out [b, q] int32: the accepted drafts then the next token at index
    `accepted`, the rest unspecified; accepted [b] int32 in 0..num_drafts).
    """
    b, q, v = logits.shape
    drafts = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), tokens.dtype)], axis=1)  # [b, q]
    real = jnp.arange(q)[None, :] < num_drafts[:, None]
    greedy = (sampling.temperature <= 0.0)[:, None]
    temp = jnp.where(greedy, 1.0, sampling.temperature[:, None])[..., None]
    if filters:  # the target is the filtered distribution (top-k / top-p / min-p), per position
        rows = jax.tree.map(lambda x: jnp.repeat(x, q, axis=0), sampling)
        filtered = filter_logits(logits.reshape(b * q, v), rows).reshape(b, q, v)
    else:
        filtered = logits
    logp = jax.nn.log_softmax(filtered / temp, axis=-1)
    top = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    # Keys per (row, position): fold (seed, output index of the token at that position).
    index = sampling.step[:, None] + jnp.arange(q)[None, :]
    keys = jax.vmap(jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i),
                             (None, 0)))(sampling.seed, index)
    split = jax.vmap(jax.vmap(lambda k: jax.random.split(k)))(keys)
    u = jax.vmap(jax.vmap(lambda k: jax.random.uniform(k)))(split[:, :, 0])
    gumbel = jax.vmap(jax.vmap(lambda k: jax.random.gumbel(k, (v,))))(split[:, :, 1])
    p_draft = jnp.exp(jnp.take_along_axis(logp, drafts[..., None], axis=-1)[..., 0])
    ok = jnp.where(greedy, top == drafts, u < p_draft) & real
    accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    # The token at a rejection: from p with the rejected draft removed.
    removed = real[..., None] & (jnp.arange(v)[None, None, :] == drafts[..., None])
    drawn = jnp.argmax(jnp.where(removed, -jnp.inf, logp) + gumbel, axis=-1).astype(jnp.int32)
    nxt = jnp.where(greedy, top, drawn)
    j = jnp.arange(q)[None, :]
    out = jnp.where(j < accepted[:, None], drafts, nxt)
    return out.astype(jnp.int32), accepted


@dataclass
class SpecCounters:
    """Cumulative speculation counters for `LLMEngine.stats()`."""

    k: int
    proposed: int = 0  # drafted tokens verified
    accepted: int = 0  # drafted tokens accepted
    verified_rows: int = 0  # (sequence, step) pairs verified with at least one draft
    emitted: int = 0  # tokens those rows produced (accepted drafts + 1)
    verify_steps: int = 0
    plain_steps: int = 0  # steps that ran without verification while speculation is on
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    per_position: list[int] = field(default_factory=list)  # accepted drafts at position j
    proposed_per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.per_position = [0] * self.k
        self.proposed_per_position = [0] * self.k

    def record(self, num_drafts: int, accepted: int) -> None:
        if num_drafts <= 0:
            return
        self.proposed += num_drafts
        self.accepted += accepted
        self.verified_rows += 1
        self.emitted += accepted + 1
        for j in range(num_drafts):
            self.proposed_per_position[j] += 1
            self.per_position[j] += j < accepted

    def stats(self) -> dict[str, object]:
        return {
            "spec_proposed_tokens": self.proposed,
            "spec_accepted_tokens": self.accepted,
            "spec_acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
            "spec_mean_accepted_length": self.emitted / self.verified_rows if self.verified_rows else 0.0,
            "spec_acceptance_per_position": [a / p if p else 0.0 for a, p in
                                             zip(self.per_position, self.proposed_per_position,
                                                 strict=True)],
            "spec_verify_steps": self.verify_steps,
            "spec_plain_steps": self.plain_steps,
            "spec_draft_time_s": self.draft_time_s,
            "spec_verify_time_s": self.verify_time_s,
        }
