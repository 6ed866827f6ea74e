"""Test helpers for paged attention: a float64 numpy oracle and a page builder.

The oracle attends over CONTIGUOUS per-sequence K/V and never sees a page.
The builder scatters that contiguous K/V into a page pool through a random
physical permutation and a ring page table, and poisons (NaN) everything a
correct kernel must not read or must mask: the dummy page 0, pages the ring
columns point to when they hold no live page, slots past each sequence's
length. Positions before the window start inside a live page hold finite
stale data, so a missing window mask changes the answer.

This module knows nothing of the kernels under test.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class PagedCache:
    k: list[np.ndarray]  # per sequence [len_i, k, e] float64 (values as stored)
    v: list[np.ndarray]
    k_pages: np.ndarray  # [k, N, s, e] float64 with NaN poison
    v_pages: np.ndarray
    page_table: np.ndarray  # int32 [b, T]


def round_to(x: np.ndarray, dtype) -> np.ndarray:
    """Round float64 values through `dtype` (e.g. bf16) and back."""
    return np.asarray(np.asarray(x, dtype=dtype), dtype=np.float64)


def build_cache(rng, lens, first_visible, *, kv_heads, head_dim, page_size, columns, dtype):
    """Pages for sequences of `lens` tokens whose queries see positions >= first_visible.

    Live pages (those holding a position in [first_visible[i], lens[i])) get
    distinct random physical pages; the ring needs `columns` >= live pages per
    sequence. Every other column points at a poison page.
    """
    s = page_size
    live = [range(lo // s, (n - 1) // s + 1) if n > 0 else range(0) for lo, n in
            zip(first_visible, lens, strict=True)]
    n_live = sum(len(r) for r in live)
    n_poison = 3
    n_pages = 1 + n_live + n_poison
    perm = rng.permutation(np.arange(1, n_pages))
    poison = perm[n_live:]
    shape = (kv_heads, n_pages, s, head_dim)
    k_pages, v_pages = np.full(shape, np.nan), np.full(shape, np.nan)
    table = rng.choice(poison, size=(len(lens), columns)).astype(np.int32)
    ks, vs, nxt = [], [], 0
    for i, (pages, n) in enumerate(zip(live, lens, strict=True)):
        assert len(pages) <= columns, "ring too narrow for the live pages"
        k = round_to(rng.standard_normal((n, kv_heads, head_dim)), dtype)
        v = round_to(rng.standard_normal((n, kv_heads, head_dim)), dtype)
        ks.append(k)
        vs.append(v)
        for logical in pages:
            phys = perm[nxt]
            nxt += 1
            table[i, logical % columns] = phys
            pos = np.arange(logical * s, min((logical + 1) * s, n))
            k_pages[:, phys, pos - logical * s] = k[pos].transpose(1, 0, 2)
            v_pages[:, phys, pos - logical * s] = v[pos].transpose(1, 0, 2)
    return PagedCache(ks, vs, k_pages, v_pages, table)


def attend_np(q, k, v, qpos, *, window, softcap, scale) -> np.ndarray:
    """One query. q [h, e] float64 at position qpos; k, v [len, kv, e] -> [h, e]."""
    h = q.shape[0]
    g = h // k.shape[1]
    kpos = np.arange(k.shape[0])
    visible = kpos <= qpos
    if window is not None:
        visible &= kpos > qpos - window
    out = np.zeros_like(q)
    if not visible.any():
        return out
    for head in range(h):
        kk, vv = k[visible, head // g], v[visible, head // g]
        logits = kk @ q[head] * scale
        if softcap is not None:
            logits = softcap * np.tanh(logits / softcap)
        p = np.exp(logits - logits.max())
        out[head] = p @ vv / p.sum()
    return out


def decode_np(q, cache: PagedCache, lens, **kw) -> np.ndarray:
    """q [b, h, e]; sequence i's query sits at lens[i] - 1. Padding rows -> zeros."""
    return np.stack([attend_np(q[i], cache.k[i], cache.v[i], n - 1, **kw)
                     for i, n in enumerate(lens)])


def prefill_np(q, cache: PagedCache, cu, lens, **kw) -> np.ndarray:
    """q [t, h, e] packed; token cu[i] + j at position lens[i] - n_i + j; tail zeros."""
    out = np.zeros_like(q)
    for i, n_cache in enumerate(lens):
        n = cu[i + 1] - cu[i]
        for j in range(n):
            out[cu[i] + j] = attend_np(q[cu[i] + j], cache.k[i], cache.v[i],
                                       n_cache - n + j, **kw)
    return out
