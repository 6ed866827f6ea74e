"""The gated delta rule over a ragged batch in chunk (WY / UT-transform) form, pure JAX.

Contract: `gated_delta.gated_delta_ragged` (this is what `impl="reference"` runs; the
token-sequential scan there is the test oracle). Within a chunk of l tokens of one
sequence, with G_i = sum_{j <= i} g_j (cumulative log decay from the chunk start) and
S_0 the state entering the chunk, the rule's per-token writes u_i = beta_i (v_i -
e^{G_i} S_0^T k_i - sum_{j<i} e^{G_i - G_j} (k_i . k_j) u_j) solve a unit lower
triangular system,

    (I + A) U = diag(beta) V - diag(beta e^G) K S_0,
    A_ij = beta_i e^{G_i - G_j} (k_i . k_j)   for j < i, else 0,

so with W = (I + A)^-1 diag(beta e^G) K and U~ = (I + A)^-1 diag(beta) V (no state in
either: computed for all chunks at once),

    U   = U~ - W S_0                                       the chunk's true writes
    S_l = e^{G_l} S_0 + (e^{G_l - G} K)^T U                the state leaving the chunk
    O   = scale (e^G Q S_0 + (Q K^T * e^{G_i - G_j} [j <= i]) U).

Only the last two lines depend on S_0: they run in a sequential scan over chunks
(t / l + b + 1 steps instead of t). Chunks never straddle sequences (`ragged.chunk_table`);
the state resets to the slot's (or zero) at each sequence's first chunk.
This module knows nothing of kernels, models or slot allocation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.ragged import gather_chunks, segments

_HI = jax.lax.Precision.HIGHEST


def unit_lower_solve(a: jax.Array, rhs: jax.Array) -> jax.Array:
    """x with (I + a) x = rhs, `a` [..., l, l] strictly lower triangular (its diagonal and
    upper part are ignored), rhs [..., l, n]: forward substitution, one row per step.

    Not `lax.linalg.triangular_solve`: on a CPU its batched solver fans out onto the
    client's thread pool and waits there, and with several devices of one process each
    running it at once (tensor parallelism on CPU devices) on a 2-core host every pool
    thread ends up waiting: the step deadlocks (seen at 128-token steps of a Qwen3.5 model
    at tensor_parallel_size=2). The substitution is the same algorithm as a row-wise
    triangular solve, in plain matmuls."""
    l = a.shape[-1]
    a = jnp.tril(a, -1)

    def row(i, x):  # rows >= i of x are still zero, so a's whole row i may be used
        xi = rhs[..., i, :] - jnp.einsum("...j,...jn->...n", a[..., i, :], x, precision=_HI)
        return jax.lax.dynamic_update_index_in_dim(x, xi, i, axis=-2)

    return jax.lax.fori_loop(0, l, row, jnp.zeros_like(rhs))


def chunk_pass(cu_seqlens, tab, real, seg, t: int, init, w, u, p, q_dec, k_dec, decay):
    """The sequential pass over chunks of a chunked gated delta rule (Gated DeltaNet and
    KDA): the state entering each chunk (the slot's `init` [b, ...], or zero, at a
    sequence's first chunk), its writes U, its output and each sequence's final state.

    Per chunk (leading axis c; heads "..."): w, u, q_dec, k_dec [c, ..., l, k or v],
    p [c, ..., l, l], decay broadcast against a state [..., k, v] (a scalar per head or a
    vector over k). -> (outputs in token order [t, heads, v] f32, padding tokens 0; the
    final states [b, ...]; an empty sequence keeps its initial state)."""
    nc, l = tab.seq.shape[0], w.shape[-2]
    first = real & (jnp.arange(nc) == tab.first[seg])
    last = real & (jnp.arange(nc) == tab.first[seg + 1] - 1)

    def body(carry, x):
        s, finals = carry
        c_first, c_last, c_seg, w_c, u_c, p_c, qd_c, kd_c, dec_c = x
        s = jnp.where(c_first, init[c_seg], s)
        u_true = u_c - jnp.einsum("...lk,...kv->...lv", w_c, s, precision=_HI)
        o = (jnp.einsum("...lk,...kv->...lv", qd_c, s, precision=_HI)
             + jnp.einsum("...ij,...jv->...iv", p_c, u_true, precision=_HI))
        s = dec_c * s + jnp.einsum("...lk,...lv->...kv", kd_c, u_true, precision=_HI)
        finals = finals.at[c_seg].set(jnp.where(c_last, s, finals[c_seg]))
        return (s, finals), o

    xs = (first, last, seg, w, u, p, q_dec, k_dec, decay)
    (_, finals), oc = jax.lax.scan(body, (jnp.zeros_like(init[0]), init), xs)
    oc = jnp.moveaxis(oc, -2, 1)  # [c, l, heads..., v]
    oc = oc.reshape(nc * l, -1, oc.shape[-1])
    sg = segments(cu_seqlens, t)
    flat = (tab.first[jnp.maximum(sg.seq, 0)] + sg.pos // l) * l + sg.pos % l
    return jnp.where((sg.pos >= 0)[:, None, None], oc[jnp.where(sg.pos >= 0, flat, 0)], 0.0), finals


@functools.partial(jax.jit, static_argnames=("scale", "chunk_size"))
def gated_delta_ragged_chunked(q, k, v, g, beta, cu_seqlens, states, slot_ids, has_initial, *,
                               scale: float, chunk_size: int = 64):
    """Chunked gated delta rule; same arguments and results as `gated_delta_ragged`.

    Shapes: t tokens, b sequences, h key heads, r value heads per key head (hv = h r),
    k = dk, v = dv, l = chunk_size, c chunks (static bound t // l + b + 1).
    """
    t = v.shape[0]
    hk, dk = q.shape[1:]
    hv, dv = v.shape[1:]
    r, l, b = hv // hk, chunk_size, cu_seqlens.shape[0] - 1
    f32 = jnp.float32
    # 1. Tokens into chunks [c, l, ...] (ragged.gather_chunks).
    tab, real, seg, (qc, kc, vc, gc, bc) = gather_chunks(l, cu_seqlens, q, k, v, g, beta)
    nc = tab.seq.shape[0]
    vc = vc.reshape(nc, l, hk, r, dv)  # [c, l, h, r, v]
    gc, bc = gc.reshape(nc, l, hk, r), bc.reshape(nc, l, hk, r)  # [c, l, h, r]

    # 2. Cumulative log decay within the chunk, G [c, h, r, l] (head-major from here on).
    G = jnp.moveaxis(jnp.cumsum(gc, axis=1), 1, -1)
    bt = jnp.moveaxis(bc, 1, -1)
    seg_decay = G[..., :, None] - G[..., None, :]  # [c, h, r, i, j]
    lower = jnp.tril(jnp.ones((l, l), bool))
    strict = jnp.tril(jnp.ones((l, l), bool), -1)
    gamma = lambda mask: jnp.where(mask, jnp.exp(jnp.where(mask, seg_decay, -jnp.inf)), 0.0)  # noqa: E731

    # 3. The UT transform: solve (I + A) [W | U~] = [diag(beta e^G) K | diag(beta) V].
    kk = jnp.einsum("cihk,cjhk->chij", kc, kc, precision=_HI)
    a = bt[..., :, None] * gamma(strict) * kk[:, :, None]
    k_h = jnp.moveaxis(kc, 1, 2)[:, :, None]  # [c, h, 1, l, k]
    rhs = jnp.concatenate([(bt * jnp.exp(G))[..., None] * k_h,
                           bt[..., None] * jnp.moveaxis(vc, 1, 3)], axis=-1)
    wu = unit_lower_solve(a, rhs)
    w, u = wu[..., :dk], wu[..., dk:]  # [c, h, r, l, k], [c, h, r, l, v]

    # 4. The state-free parts of the output and of the state update.
    qk = jnp.einsum("cihk,cjhk->chij", qc, kc, precision=_HI)
    p = qk[:, :, None] * gamma(lower)  # [c, h, r, i, j]
    q_dec = jnp.moveaxis(qc, 1, 2)[:, :, None] * jnp.exp(G)[..., None]  # [c, h, r, l, k]
    k_dec = k_h * jnp.exp(G[..., -1:] - G)[..., None]  # e^{G_l - G_j} k_j
    chunk_decay = jnp.exp(G[..., -1])  # [c, h, r]

    # 5. Sequential pass over chunks, back to token order (`chunk_pass`).
    init = jnp.where(has_initial[:, None, None, None], states[slot_ids].astype(f32), 0.0)
    o, finals = chunk_pass(cu_seqlens, tab, real, seg, t, init.reshape(b, hk, r, dk, dv), w, u, p,
                           q_dec, k_dec, chunk_decay[..., None, None])
    o = o * scale
    finals = finals.reshape(b, hv, dk, dv)
    return o.astype(v.dtype), states.at[slot_ids].set(finals.astype(states.dtype))
