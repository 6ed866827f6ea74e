"""Kimi Delta Attention (KDA): the gated delta rule with a per-channel decay, chunked, pure JAX.

Contract: `gated_delta.gated_delta_ragged` with g [t, hv, dk] (a log decay per value head
AND key channel, <= 0); the token-sequential scan there (`gated_delta_ragged_reference`)
is the test oracle. This is what the engine runs for KDA prefill on every backend (no
Pallas kernel yet: docs/kernels.md). Per token the state S [dk, dv] of a head does

    S <- diag(e^{g_t}) S;   S <- S + beta_t k_t (v_t - S^T k_t)^T;   o_t = scale S^T q_t.

Within a chunk of l tokens, with G_i = sum_{j <= i} g_j [dk] (cumulative from the chunk
start), Gamma_{i<-j} = diag(e^{G_i - G_j}) and S_0 the state entering the chunk, the
writes u_i = beta_i (v_i - (e^{G_i} k_i)^T S_0 - sum_{j<i} (k_i^T Gamma_{i<-j} k_j) u_j)
solve the unit lower triangular system of Gated DeltaNet's chunk form
(`gated_delta_chunked.py`) with the scalar decay replaced by a per-channel one inside the
dot products:

    A_ij = beta_i k_i^T Gamma_{i<-j} k_j  (j < i),   P_ij = q_i^T Gamma_{i<-j} k_j  (j <= i)
    (I + A) [W | U~] = [diag(beta) (e^G * K) | diag(beta) V],   U = U~ - W S_0
    O   = scale ((e^G * Q) S_0 + P U)
    S_l = diag(e^{G_l}) S_0 + ((e^{G_l - G} * K))^T U.

Numerics: e^{G_i - G_j} with j <= i is <= 1 (g <= 0), but written as e^{G_i} e^{-G_j} it
overflows for strong decays (the factors reach e^{+-hundreds} within a chunk). So the
pairwise products are taken (as flash-linear-attention's KDA does) in sub-chunks of s
tokens: pairs in an earlier sub-chunk J < I go through the first position r of I,
e^{G_i - G_r} e^{G_r - G_j}, both factors <= 1 (one batched product per sub-chunk row);
pairs inside one sub-chunk take e^{G_i - G_j} per pair (s shifted elementwise passes,
O(t s dk) memory-light work). Every exponent is <= 0, so nothing overflows; what
underflows is below f32's resolution of the true product anyway.
This module knows nothing of kernels, models or slot allocation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta_chunked import chunk_pass, unit_lower_solve
from pallas_kernels.ragged import gather_chunks

_HI = jax.lax.Precision.HIGHEST
SUB = 16  # sub-chunk rows (the pairwise exact part)


def decayed_dots(x: jax.Array, y: jax.Array, G: jax.Array, *, strict: bool, sub: int) -> jax.Array:
    """M_ij = sum_c x_ic y_jc e^{G_ic - G_jc} for j < i (strict) or j <= i, else 0.

    x, y, G [c, l, h, k] (G cumulative and non-increasing along l); returns [c, h, l, l].
    """
    c, l, h, k = x.shape
    s = min(sub, l)
    n = l // s
    neg_inf = -jnp.inf
    # 1. Pairs in an earlier sub-chunk: through the first row r of the query's sub-chunk.
    g_ref = G[:, ::s]  # [c, n, h, k]
    xs = x.reshape(c, n, s, h, k) * jnp.exp(G.reshape(c, n, s, h, k) - g_ref[:, :, None])
    before = jnp.arange(l)[None, :] < (jnp.arange(n) * s)[:, None]  # [n, l]: j < start of I
    expo = jnp.where(before[None, :, :, None, None], g_ref[:, :, None] - G[:, None], neg_inf)
    ys = y[:, None] * jnp.exp(expo)  # [c, n, l, h, k]
    off = jnp.einsum("cnihk,cnjhk->chnij", xs, ys, precision=_HI).reshape(c, h, l, l)
    # 2. Pairs inside one sub-chunk, d = i - j in [0, s): shifted elementwise products.
    pos = jnp.arange(l) % s
    diag = []
    for d in range(s):
        ok = pos >= d  # j = i - d in the same sub-chunk
        y_d, g_d = jnp.roll(y, d, axis=1), jnp.roll(G, d, axis=1)
        e = jnp.exp(jnp.where(ok[None, :, None, None], G - g_d, neg_inf))
        diag.append(jnp.sum(x * y_d * e, axis=-1))  # [c, l, h]
    dg = jnp.moveaxis(jnp.stack(diag, -1), 1, 2)  # [c, h, l(i), s(d)]
    i, j = jnp.arange(l)[:, None], jnp.arange(l)[None, :]
    inside = (i // s == j // s) & (j < i if strict else j <= i)
    idx = jnp.broadcast_to(jnp.clip(i - j, 0, s - 1), (c, h, l, l))
    near = jnp.where(inside, jnp.take_along_axis(dg, idx, axis=-1), 0.0)
    return off + near


@functools.partial(jax.jit, static_argnames=("scale", "chunk_size", "sub"))
def kda_ragged_chunked(q, k, v, g, beta, cu_seqlens, states, slot_ids, has_initial, *,
                       scale: float, chunk_size: int = 64, sub: int = SUB):
    """Chunked KDA; same arguments and results as `gated_delta_ragged` with g [t, hv, dk].

    Shapes: t tokens, b sequences, h value heads (q and k repeated from their key heads),
    k = dk, v = dv, l = chunk_size, c chunks (static bound t // l + b + 1).
    """
    t = v.shape[0]
    hk = q.shape[1]
    h, dv = v.shape[1:]
    dk = q.shape[2]
    l = chunk_size
    f32 = jnp.float32
    rep = lambda x: jnp.repeat(x, h // hk, axis=1)  # noqa: E731  key heads -> value heads
    # 1. Tokens into chunks [c, l, ...] (ragged.gather_chunks).
    tab, real, seg, (qc, kc, vc, gc, bc) = gather_chunks(l, cu_seqlens, rep(q), rep(k), v, g, beta)

    # 2. Cumulative log decay per channel within the chunk, and the decayed pair products.
    G = jnp.cumsum(gc, axis=1)  # [c, l, h, k]
    kk = decayed_dots(kc, kc, G, strict=True, sub=sub)  # [c, h, l, l]
    p = decayed_dots(qc, kc, G, strict=False, sub=sub)
    hm = lambda x: jnp.moveaxis(x, 1, 2)  # noqa: E731  [c, l, h, ...] -> [c, h, l, ...]
    bt = hm(bc)  # [c, h, l]

    # 3. The UT transform: (I + A) [W | U~] = [diag(beta) (e^G * K) | diag(beta) V].
    a = bt[..., None] * kk
    rhs = bt[..., None] * jnp.concatenate([hm(kc * jnp.exp(G)), hm(vc)], axis=-1)
    wu = unit_lower_solve(a, rhs)
    w, u = wu[..., :dk], wu[..., dk:]  # [c, h, l, k], [c, h, l, v]

    # 4. The state-free factors of the output and of the state update.
    g_last = G[:, -1]  # [c, h, k]
    q_dec = hm(qc * jnp.exp(G))
    k_dec = hm(kc * jnp.exp(g_last[:, None] - G))
    chunk_decay = jnp.exp(g_last)

    # 5. Sequential pass over chunks, back to token order (gated_delta_chunked.chunk_pass).
    init = jnp.where(has_initial[:, None, None, None], states[slot_ids].astype(f32), 0.0)
    o, finals = chunk_pass(cu_seqlens, tab, real, seg, t, init, w, u, p, q_dec, k_dec, chunk_decay[..., None])
    o = o * scale
    return o.astype(v.dtype), states.at[slot_ids].set(finals.astype(states.dtype))
