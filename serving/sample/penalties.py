"""Logit bias, repetition, presence and frequency penalties, from per-slot tables on device.

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

Each slot also holds its request's logit bias (`bias_ids` / `bias_values`, up to
MAX_LOGIT_BIAS pairs, id -1 unused), added to the logits before the penalties. The
step never writes them: the host sets a slot's row when a request that differs from the
row's owner samples there (`set_logit_bias`, serving/runner/runner.py).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from serving.sample.sampling_params import MAX_LOGIT_BIAS


class TokenStats(NamedTuple):
    counts: jax.Array  # [slots, v] int32: output occurrences
    seen: jax.Array  # [slots, v] bool: in prompt or output
    bias_ids: jax.Array  # [slots, MAX_LOGIT_BIAS] int32: biased token ids, -1 = unused
    bias_values: jax.Array  # [slots, MAX_LOGIT_BIAS] f32


def init_token_stats(num_slots: int, vocab: int) -> TokenStats:
    return TokenStats(jnp.zeros((num_slots, vocab), jnp.int32), jnp.zeros((num_slots, vocab), bool),
                      jnp.full((num_slots, MAX_LOGIT_BIAS), -1, jnp.int32),
                      jnp.zeros((num_slots, MAX_LOGIT_BIAS), jnp.float32))


def bias_row(pairs: tuple[tuple[int, float], ...]) -> tuple[np.ndarray, np.ndarray]:
    """A slot's (ids, values) rows for `SamplingParams.logit_bias` pairs (host side)."""
    ids = np.full(MAX_LOGIT_BIAS, -1, np.int32)
    values = np.zeros(MAX_LOGIT_BIAS, np.float32)
    ids[:len(pairs)] = [t for t, _ in pairs]
    values[:len(pairs)] = [b for _, b in pairs]
    return ids, values


def set_logit_bias(stats: TokenStats, slot: jax.Array, ids: jax.Array, values: jax.Array) -> TokenStats:
    """Slot `slot`'s bias row replaced by (ids, values) (jit it with `stats` donated)."""
    return stats._replace(bias_ids=stats.bias_ids.at[slot].set(ids),
                          bias_values=stats.bias_values.at[slot].set(values))


def apply_logit_bias(logits: jax.Array, stats: TokenStats, slot_ids: jax.Array) -> jax.Array:
    """logits [b, v] plus each row's slot's bias (unused entries add 0 to token 0)."""
    ids = stats.bias_ids[slot_ids]
    values = jnp.where(ids >= 0, stats.bias_values[slot_ids], 0.0).astype(logits.dtype)
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, jnp.maximum(ids, 0)].add(values)


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
    return stats._replace(counts=counts, seen=seen)


def apply_penalties(logits: jax.Array, stats: TokenStats, slot_ids: jax.Array,
                    repetition: jax.Array, presence: jax.Array, frequency: jax.Array) -> jax.Array:
    """logits [b, v] with each row's penalties applied from its slot's statistics."""
    counts = stats.counts[slot_ids].astype(logits.dtype)
    seen = stats.seen[slot_ids]
    rep = repetition[:, None]
    penalised = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(seen, penalised, logits)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)
