"""Greedy decoding by recomputing the full-sequence forward every step (no cache).

O(t^2) and slow: this is the reference that the serving engine's cached, paged,
batched decoding must reproduce token for token, and the simplest way to run a
model. Sequences are right-padded to a fixed length so the forward compiles once;
every mixer is causal, so logits at position i see only tokens <= i.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hybrid_jax.model import CausalLM


def greedy_steps(model: CausalLM, prompt: Sequence[int], max_new_tokens: int, *,
                 eos_ids: Sequence[int] = ()) -> Iterator[tuple[int, float]]:
    """Yield (token, top1 - top2 logit gap) per step; stops after an EOS token."""
    if not prompt:
        raise ValueError("prompt must hold at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    total = len(prompt) + max_new_tokens
    fwd = jax.jit(lambda ids, i: jax.lax.dynamic_index_in_dim(model(ids)[0], i, keepdims=False))
    ids = np.zeros((1, total), np.int32)
    ids[0, :len(prompt)] = prompt
    for step in range(max_new_tokens):
        cur = len(prompt) + step
        logits = np.asarray(fwd(jnp.asarray(ids), cur - 1))
        top2 = np.partition(logits, -2)[-2:]
        tok = int(np.argmax(logits))
        yield tok, float(abs(top2[1] - top2[0]))
        if tok in eos_ids:
            return
        ids[0, cur] = tok


def greedy_generate(model: CausalLM, prompt: Sequence[int], max_new_tokens: int, *,
                    eos_ids: Sequence[int] = ()) -> list[int]:
    """Greedy continuation of `prompt` (at most max_new_tokens; stops after EOS)."""
    return [tok for tok, _ in greedy_steps(model, prompt, max_new_tokens, eos_ids=eos_ids)]
