"""Repetition, presence and frequency penalties, from per-slot token statistics on device.

Each state slot keeps, over the vocabulary, how many times each token was generated
(`counts`, output tokens only) and whether it was seen at all (`seen`, prompt or
output). The step updates them from its input tokens before sampling: a first chunk
zeroes its slot's rows; every input token marks `seen`; input tokens at positions
>= the prompt length are outputs fed back (the token sampled last step, or the
generated part of a recompute after preemption) and add to `counts`. So at sampling
time the statistics cover the prompt and every output token so far, identically in
a solo run, a batch, or after preemption. Meanings follow vLLM:
  repetition r: seen tokens' logits l -> l / r if l > 0 else l * r
  frequency f, presence p: l -> l - f * count - p * (count > 0)
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class TokenStats(NamedTuple):
    counts: jax.Array  # [slots, v] int32: output occurrences
    seen: jax.Array  # [slots, v] bool: in prompt or output


def init_token_stats(num_slots: int, vocab: int) -> TokenStats:
    return TokenStats(jnp.zeros((num_slots, vocab), jnp.int32), jnp.zeros((num_slots, vocab), bool))


def update_token_stats(stats: TokenStats, tokens: jax.Array, positions: jax.Array,
                       cu_seqlens: jax.Array, slot_ids: jax.Array, has_initial: jax.Array,
                       prompt_lens: jax.Array, *, continues: bool = False) -> TokenStats:
    """Fold this step's input tokens [t] into the per-slot statistics (see module doc).

    continues (static): every real row continues its sequence (has_initial True: a
    decode, verification or multi-step executable, whose only other rows are padding on
    the dummy slot 0), so no row is zeroed. Otherwise the slots of first chunks are
    zeroed; the other rows' indices fall outside the array and are dropped, so a step
    writes only the rows it resets (multiplying every row by has_initial read and wrote
    b full vocabulary rows twice per step: 46 us a scatter at b = 256, H100).
    """
    if not continues:
        reset = jnp.where(has_initial, stats.counts.shape[0], slot_ids)  # out of range: dropped
        counts = stats.counts.at[reset].set(0, mode="drop")
        seen = stats.seen.at[reset].set(False, mode="drop")
    else:
        counts, seen = stats.counts, stats.seen
    t = tokens.shape[0]
    # compare_all: no loop (the default method is a while loop, which on a GPU runs outside
    # the step's CUDA graph, its kernels launched one by one by the host, and splits the graph)
    row = jnp.searchsorted(cu_seqlens[1:], jnp.arange(t), side="right", method="compare_all")
    valid = jnp.arange(t) < cu_seqlens[-1]
    row = jnp.where(valid, row, 0)
    slot = jnp.where(valid, slot_ids[row], 0)  # padding tokens touch the dummy slot 0
    output = valid & (positions >= prompt_lens[row])
    counts = counts.at[slot, tokens].add(output.astype(jnp.int32))
    seen = seen.at[slot, tokens].max(valid)
    return TokenStats(counts, seen)


def apply_penalties(logits: jax.Array, stats: TokenStats, slot_ids: jax.Array,
                    repetition: jax.Array, presence: jax.Array, frequency: jax.Array) -> jax.Array:
    """logits [b, v] with each row's penalties applied from its slot's statistics."""
    counts = stats.counts[slot_ids].astype(logits.dtype)
    seen = stats.seen[slot_ids]
    rep = repetition[:, None]
    penalised = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(seen, penalised, logits)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)
