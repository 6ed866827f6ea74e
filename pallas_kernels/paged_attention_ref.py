"""Pure-JAX references for paged attention (decode and ragged prefill).

Each reference rebuilds contiguous K/V for a sequence by walking its logical
pages through the ring page table, then attends with an explicit causal and
window mask. They share no code with the Pallas kernels. They are also what
CPU serving runs, so they gather only the pages a query can see (never pages
that left the window, which may belong to another sequence) and stay jittable
with static shapes.

Shapes (see docs/shapes.md): q [b, h, e] (decode) or [t, h, e] (prefill);
k_pages, v_pages [k, N, s, e]; page_table int32 [b, T] (a ring); lengths
int32 [b]; cu_q_lens int32 [b + 1]. FP8 pages (float8_e4m3fn) come with k_scale,
v_scale f32 [k]: the real K/V of head j is page values times scale[j]; the references
dequantize the rebuilt K/V into q's dtype before attending.

This module knows attention math and the page layout, nothing of scheduling.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_HIGHEST = lax.Precision.HIGHEST


def _pages_spanned(num_positions: int, page_size: int) -> int:
    """Most pages that `num_positions` consecutive positions can touch."""
    return -(-(num_positions - 1) // page_size) + 1


def _gather_span(k_pages, v_pages, table_row, first_page, num_pages, lo, hi):
    """Contiguous K/V of logical pages [first_page, first_page + num_pages).

    Returns k, v [k, num_pages * s, e], key positions [num_pages * s] and the
    mask of positions inside [lo, hi). Pages holding no position of [lo, hi)
    are read from the dummy page 0 and their rows zeroed.
    """
    s = k_pages.shape[2]
    logical = first_page + jnp.arange(num_pages, dtype=jnp.int32)
    live = (logical * s < hi) & ((logical + 1) * s > lo)
    phys = jnp.where(live, table_row[logical % table_row.shape[0]], 0)
    kpos = (logical[:, None] * s + jnp.arange(s, dtype=jnp.int32)).reshape(-1)
    in_span = (kpos >= lo) & (kpos < hi)
    nk, e = k_pages.shape[0], k_pages.shape[3]

    def rebuild(pages):
        rows = pages[:, phys].reshape(nk, num_pages * s, e)
        return jnp.where(in_span[None, :, None], rows, jnp.zeros_like(rows))

    return rebuild(k_pages), rebuild(v_pages), kpos, in_span


def _dequantize(k, v, k_scale, v_scale, dtype):
    """Rebuilt K/V [k, n, e] as attended: FP8 values times their head's scale in f32,
    then `dtype`; unquantized K/V as they are."""
    if k_scale is None:
        return k, v
    deq = lambda x, sc: (x.astype(jnp.float32) * sc[:, None, None]).astype(dtype)  # noqa: E731
    return deq(k, k_scale), deq(v, v_scale)


def _attend(q, k, v, visible, softcap, scale):
    """q [r, k, g, e], k/v [k, n, e], visible [r, n] -> [r, k, g, e] in f32."""
    logits = jnp.einsum("rkge,kne->rkgn", q, k, precision=_HIGHEST,
                        preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    logits = jnp.where(visible[:, None, None, :], logits, -jnp.inf)
    m = jnp.maximum(jnp.max(logits, axis=-1, keepdims=True), -1e30)
    p = jnp.exp(logits - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("rkgn,kne->rkge", p, v.astype(jnp.float32), precision=_HIGHEST)
    return out / jnp.where(denom == 0.0, 1.0, denom)


def rope_reference(x, cos, sin):
    """Rotate-half RoPE of the first r dims of x [t, heads, e] (cos, sin [t, r] f32, cast
    to x's dtype; products and sum in x's dtype); the other e - r dims pass through."""
    r, half = cos.shape[-1], cos.shape[-1] // 2
    x_rot, x_pass = x[..., :r], x[..., r:]
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    out = x_rot * cos[:, None].astype(x.dtype) + rotated * sin[:, None].astype(x.dtype)
    return jnp.concatenate([out, x_pass], axis=-1) if x_pass.shape[-1] else out


def paged_attention_decode_reference(
    q, k_pages, v_pages, lengths, page_table, *, window=None, softcap=None, scale=None,
    k_scale=None, v_scale=None,
):
    """Decode attention; the query of sequence i sits at position lengths[i] - 1.

    1. Sequence i sees keys [lo, len) with lo = max(0, len - w) (0 if global).
    2. Rebuild its contiguous K/V over the pages covering [lo, len) (ring walk);
       FP8 pages dequantized with their heads' scales.
    3. logits = scale * q.k, soft-capped, masked to [lo, len); softmax; sum of v.
    Rows with lengths == 0 see no key and return zeros.
    """
    b, h, e = q.shape
    nk, _, s, _ = k_pages.shape
    num_cols = page_table.shape[1]
    scale = e**-0.5 if scale is None else scale
    span = num_cols if window is None else min(num_cols, _pages_spanned(window, s))
    lo = jnp.zeros_like(lengths) if window is None else jnp.maximum(lengths - window, 0)

    def one(qi, row, lo_i, len_i):
        k, v, _, visible = _gather_span(k_pages, v_pages, row, lo_i // s, span, lo_i, len_i)
        k, v = _dequantize(k, v, k_scale, v_scale, q.dtype)
        qi = qi.astype(k.dtype).reshape(1, nk, h // nk, e)
        return _attend(qi, k, v, visible[None], softcap, scale)[0]

    out = jax.vmap(one)(q, page_table, lo, lengths)
    return out.reshape(b, h, e).astype(q.dtype)


def _query_chunk(t: int, keys: int, heads: int) -> int:
    """Static query-chunk length: bound the [chunk, h, keys] logits to ~2^26."""
    c = max(1, min(t, 256, 2**26 // max(1, keys * heads)))
    return 1 << (c.bit_length() - 1)


def paged_attention_prefill_reference(
    q, k_pages, v_pages, cu_q_lens, lengths, page_table, *,
    window=None, softcap=None, scale=None, k_scale=None, v_scale=None,
):
    """Ragged prefill attention over paged K/V (chunked prefill).

    1. Sequence i owns queries q[cu[i]:cu[i+1]] (n_i tokens) at positions
       lengths[i] - n_i + j; its K/V for all positions < lengths[i] is paged.
    2. Walk its queries in chunks of c tokens. A chunk at positions [p0, p1]
       sees keys [lo, p1 + 1) with lo = max(0, p0 - w + 1) (0 if global).
    3. Rebuild contiguous K/V over those pages (ring walk; FP8 pages dequantized
       with their heads' scales) and attend with the mask  q - w < key <= q  per query.
    Tokens past cu[b] (bucket padding) return zeros.
    """
    t, h, e = q.shape
    nk, _, s, _ = k_pages.shape
    b, num_cols = page_table.shape
    scale = e**-0.5 if scale is None else scale
    global_span = num_cols * s
    chunk = _query_chunk(t, global_span if window is None else window, h)
    span = num_cols if window is None else min(num_cols, _pages_spanned(chunk + window, s))
    kv_dtype = k_pages.dtype if k_scale is None else q.dtype
    qp = jnp.pad(q.astype(kv_dtype), ((0, chunk), (0, 0), (0, 0)))
    out = jnp.zeros((t + chunk, h, e), jnp.float32)

    def chunk_body(i, j, out):
        n = cu_q_lens[i + 1] - cu_q_lens[i]
        start = cu_q_lens[i] + j * chunk
        qpos = lengths[i] - n + j * chunk + jnp.arange(chunk, dtype=jnp.int32)
        valid = j * chunk + jnp.arange(chunk) < n
        hi = jnp.max(jnp.where(valid, qpos, 0)) + 1
        lo = 0 if window is None else jnp.maximum(qpos[0] - window + 1, 0)
        k, v, kpos, in_span = _gather_span(
            k_pages, v_pages, page_table[i], lo // s, span, lo, hi)
        k, v = _dequantize(k, v, k_scale, v_scale, q.dtype)
        visible = (kpos[None, :] <= qpos[:, None]) & in_span[None, :] & valid[:, None]
        if window is not None:
            visible &= kpos[None, :] > qpos[:, None] - window
        qc = lax.dynamic_slice_in_dim(qp, start, chunk).reshape(chunk, nk, h // nk, e)
        oc = _attend(qc, k, v, visible, softcap, scale).reshape(chunk, h, e)
        old = lax.dynamic_slice_in_dim(out, start, chunk)
        return lax.dynamic_update_slice_in_dim(
            out, jnp.where(valid[:, None, None], oc, old), start, 0)

    def seq_body(i, out):
        n = cu_q_lens[i + 1] - cu_q_lens[i]
        return lax.fori_loop(0, (n + chunk - 1) // chunk, lambda j, o: chunk_body(i, j, o), out)

    out = lax.fori_loop(0, b, seq_body, out)
    return out[:t].astype(q.dtype)
