"""Bookkeeping for ragged batches: sequences packed along the token axis.

A ragged batch is `t` tokens and `cu_seqlens` int32 [b+1] (cumulative offsets,
`cu_seqlens[0] == 0`). Tokens at or past `cu_seqlens[b]` are padding. Every
table here is built in XLA with static shapes from `t`, `b` and a chunk length,
so the ops that use them jit once per shape bucket.

This module knows nothing of kernels, states or models; the values of
`cu_seqlens` (monotone, within `t`) are checked by the host that builds them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Segments(NamedTuple):
    """Per-token view of a ragged batch.

    seq: int32 [t], the token's sequence in [0, b); b for padding tokens.
    pos: int32 [t], the token's position within its sequence; -1 for padding.
    """

    seq: jax.Array
    pos: jax.Array


class ChunkTable(NamedTuple):
    """Chunks of at most `l` tokens that never straddle a sequence.

    Sequences 0..b-1 are cut into ceil(len/l) chunks each, in order; the padding
    tail [cu_seqlens[b], t) is cut the same way and marked with seq == b. Unused
    rows of the (static) table have seq == b + 1 and start == end.

    seq:    int32 [nc]   sequence of the chunk (b: padding tail, b+1: unused).
    start:  int32 [nc]   first token of the chunk.
    end:    int32 [nc]   one past its last token.
    window: int32 [nc]   start of an l-token window inside [0, t) that holds the
                         chunk (start clamped to t - l), so loads never leave the
                         buffer; rows of the window outside [start, end) are masked.
    first:  int32 [b+2]  index of each sequence's first chunk (b: padding tail);
                         first[i + 1] - first[i] is the number of chunks of i.
    """

    seq: jax.Array
    start: jax.Array
    end: jax.Array
    window: jax.Array
    first: jax.Array


def num_chunks(t: int, b: int, l: int) -> int:
    """Static bound on the chunks of `b` sequences plus padding in `t` tokens.

    sum_i ceil(len_i / l) <= floor(t / l) + (b + 1) over the b + 1 segments.
    """
    return t // l + b + 1


def segments(cu_seqlens: jax.Array, t: int) -> Segments:
    """The sequence and in-sequence position of each of `t` tokens."""
    b = cu_seqlens.shape[0] - 1
    tok = jnp.arange(t, dtype=jnp.int32)
    # compare_all: no while loop in the step (see serving/sample/penalties.py)
    seq = jnp.searchsorted(cu_seqlens[1:], tok, side="right", method="compare_all").astype(jnp.int32)
    start = cu_seqlens[jnp.minimum(seq, b - 1)]
    pos = jnp.where(seq < b, tok - start, -1)
    return Segments(seq=seq, pos=pos)


def chunk_table(cu_seqlens: jax.Array, t: int, l: int) -> ChunkTable:
    """Cut each sequence (and the padding tail) into chunks of at most `l` tokens."""
    if t < l:
        raise ValueError(f"{t=} must be at least the chunk length {l=} (pad the tokens)")
    b = cu_seqlens.shape[0] - 1
    cu = jnp.concatenate([cu_seqlens.astype(jnp.int32), jnp.array([t], jnp.int32)])
    lens = cu[1:] - cu[:-1]  # [b+1], the last one is the padding tail
    counts = (lens + l - 1) // l
    first = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts, dtype=jnp.int32)])
    nc = num_chunks(t, b, l)
    c = jnp.arange(nc, dtype=jnp.int32)
    seq = jnp.searchsorted(first[1:], c, side="right", method="compare_all").astype(jnp.int32)  # b+1: unused
    used = seq <= b
    seg = jnp.minimum(seq, b)
    start = cu[seg] + (c - first[seg]) * l
    end = jnp.minimum(start + l, cu[seg + 1])
    start = jnp.where(used, start, 0)
    end = jnp.where(used, end, 0)
    window = jnp.minimum(start, t - l)
    return ChunkTable(seq=seq, start=start, end=end, window=window, first=first)


def pad_tokens(l: int, *arrays):
    """Pad token-major arrays to at least `l` tokens (the padding is past cu_seqlens[b])."""
    t = arrays[0].shape[0]
    if t >= l:
        return arrays
    return tuple(
        None if a is None else jnp.pad(a, [(0, l - t)] + [(0, 0)] * (a.ndim - 1)) for a in arrays
    )


def gather_chunks(l: int, cu_seqlens: jax.Array, *xs: jax.Array):
    """Tokens [t, ...] -> chunks [c, l, ...] in f32 (the chunks of `chunk_table`); rows
    outside a chunk's sequence are zero (g = 0 keeps the state, beta = k = 0 writes
    nothing). -> (table, real [c] (a chunk of a sequence), seg [c] (its sequence, clamped),
    the chunked arrays). The chunked gated delta rules' first step (gated_delta_chunked.py,
    kda_chunked.py); ssd.py gathers the same way by hand."""
    xs = pad_tokens(l, *xs)
    b, tp = cu_seqlens.shape[0] - 1, xs[0].shape[0]
    tab = chunk_table(cu_seqlens, tp, l)
    real = tab.seq < b
    idx = tab.start[:, None] + jnp.arange(l)
    valid = (idx < tab.end[:, None]) & real[:, None]
    idx = jnp.minimum(idx, tp - 1)
    mask = lambda x: valid.reshape(*valid.shape, *(1,) * (x.ndim - 1))  # noqa: E731
    chunks = tuple(jnp.where(mask(x), x[idx].astype(jnp.float32), 0.0) for x in xs)
    return tab, real, jnp.minimum(tab.seq, b - 1), chunks
