"""Random paged-attention inputs and a timer for `bench_attention.py`.

Builds page pools with a random physical permutation and ring page tables
sized to the window (the way the engine frees pages), so a sequence at
context 131072 occupies no more pool than one at 8192. Knows nothing of the
kernels it feeds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np


def ring_columns(window: int | None, max_len: int, page_size: int) -> int:
    """Ring width: the pages W consecutive positions can span (all pages if global)."""
    if window is None:
        return -(-max_len // page_size)
    return -(-(window - 1) // page_size) + 1


def paged_pool(rng, batch, lengths, first_visible, *, kv_heads, head_dim, page_size,
               columns, dtype=jnp.bfloat16):
    """(k_pages, v_pages, page_table): live pages of each sequence at random physical slots."""
    live = [np.arange(lo // page_size, (n - 1) // page_size + 1)
            for lo, n in zip(first_visible, lengths, strict=True)]
    n_pages = 1 + batch * columns
    perm = rng.permutation(np.arange(1, n_pages)).astype(np.int32)
    table = np.zeros((batch, columns), np.int32)
    for i, pages in enumerate(live):
        assert len(pages) <= columns
        table[i, pages % columns] = perm[i * columns: i * columns + len(pages)]
    shape = (kv_heads, n_pages, page_size, head_dim)
    key_k, key_v = jax.random.split(jax.random.key(int(rng.integers(2**31))))
    k_pages = jax.random.normal(key_k, shape, dtype)
    v_pages = jax.random.normal(key_v, shape, dtype)
    return k_pages, v_pages, jnp.asarray(table)


def decode_inputs(rng, *, batch, context, window, heads=32, kv_heads=8, head_dim=128,
                  page_size=16, dtype=jnp.bfloat16):
    """Decode inputs where every sequence holds `context` tokens."""
    lengths = np.full(batch, context, np.int32)
    first = lengths - (context if window is None else min(window, context))
    columns = ring_columns(window, context, page_size)
    k_pages, v_pages, table = paged_pool(
        rng, batch, lengths, first, kv_heads=kv_heads, head_dim=head_dim,
        page_size=page_size, columns=columns, dtype=dtype)
    q = jax.random.normal(jax.random.key(int(rng.integers(2**31))), (batch, heads, head_dim), dtype)
    return q, k_pages, v_pages, jnp.asarray(lengths), table


def prefill_inputs(rng, *, seqs, new_tokens, context, window, heads=32, kv_heads=8,
                   head_dim=128, page_size=16, dtype=jnp.bfloat16):
    """`seqs` sequences of `new_tokens` queries each, ending at `context` tokens."""
    lengths = np.full(seqs, context, np.int32)
    first_q = context - new_tokens
    first = np.full(seqs, 0 if window is None else max(0, first_q - window + 1))
    columns = ring_columns(None if window is None else window + new_tokens, context, page_size)
    k_pages, v_pages, table = paged_pool(
        rng, seqs, lengths, first, kv_heads=kv_heads, head_dim=head_dim,
        page_size=page_size, columns=columns, dtype=dtype)
    cu = jnp.asarray(np.arange(seqs + 1) * new_tokens, jnp.int32)
    shape = (seqs * new_tokens, heads, head_dim)
    q = jax.random.normal(jax.random.key(int(rng.integers(2**31))), shape, dtype)
    return q, k_pages, v_pages, cu, jnp.asarray(lengths), table


def time_fn(fn: Callable, *args, target_s: float = 0.05, rounds: int = 7) -> float:
    """Median seconds per call: `rounds` rounds of back-to-back calls after warm-up.

    Calls within a round are dispatched asynchronously and synchronised once,
    so host dispatch overlaps device work. A jitted `fn` is assumed.
    """
    jax.block_until_ready(fn(*args))  # compile + warm-up
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    once = max(time.perf_counter() - start, 1e-6)
    reps = max(3, min(2000, int(target_s / once)))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        out = None
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / reps)
    return statistics.median(times)
