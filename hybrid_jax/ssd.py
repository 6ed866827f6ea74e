"""Chunked state-space duality (SSD) for Mamba2, full sequences, pure JAX.

The full-sequence forward of the Mamba2 mixer: training and the reference that the
serving path (ragged batches, per-slot states, Pallas kernels) is checked against.
It knows nothing of pages, slots or kernels.

Recurrence per head h (group g = h // (H / G)):
    S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t (outer) B_t        S [p, n]
    y_t = S_t C_t + D_h x_t
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def process_dt(dt: jax.Array, dt_bias: jax.Array, dt_limit: tuple[float, float]) -> jax.Array:
    """Raw dt [..., h] -> clamp(softplus(dt + bias), *dt_limit) in f32."""
    dt = jax.nn.softplus(dt.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    return jnp.clip(dt, dt_limit[0], dt_limit[1])


def segsum(x: jax.Array) -> jax.Array:
    """x [..., l] -> [..., l, l] with out[i, j] = sum(x[j+1..i]) for i >= j, else -inf.

    Computed as a masked cumsum (not a difference of cumsums) so it stays exact
    when the running sums grow large.
    """
    l = x.shape[-1]
    xx = jnp.broadcast_to(x[..., None], (*x.shape, l))  # [..., i, j] = x[i]
    strict = jnp.tril(jnp.ones((l, l), bool), k=-1)
    out = jnp.cumsum(jnp.where(strict, xx, 0.0), axis=-2)
    return jnp.where(jnp.tril(jnp.ones((l, l), bool)), out, -jnp.inf)


def _chunk_state_scan(decay: jax.Array, states: jax.Array, init: jax.Array) -> jax.Array:
    """Inter-chunk passing: S_c = decay_c * S_{c-1} + states_c, via lax.associative_scan.

    decay [b, c, h], states [b, c, h, p, n], init [b, h, p, n]
    -> states entering each chunk [b, c + 1, h, p, n] (index 0 = init, last = final).
    """
    a = jnp.concatenate([jnp.ones_like(decay[:, :1]), decay], axis=1)
    s = jnp.concatenate([init[:, None], states], axis=1)

    def combine(left, right):
        a_l, s_l = left
        a_r, s_r = right
        return a_l * a_r, a_r[..., None, None] * s_l + s_r

    _, out = jax.lax.associative_scan(combine, (a, s), axis=1)
    return out


def ssd_chunked(x: jax.Array, dt: jax.Array, A: jax.Array, B: jax.Array, C: jax.Array,
                D: jax.Array, *, chunk_size: int,
                initial_state: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """SSD over full sequences.

    x  [b, t, h, p]   inputs (any float dtype; math in f32)
    dt [b, t, h]      processed step sizes (see `process_dt`), f32
    A  [h]            negative decay rates (A = -exp(A_log))
    B  [b, t, g, n]   input projections;  C [b, t, g, n] output projections
    D  [h]            skip
    initial_state [b, h, p, n] or None (zeros)
    returns y [b, t, h, p] f32 and the final state [b, h, p, n] f32.

    1. Pad t to a multiple of l with dt = 0 (no decay, no input: the state is unchanged).
    2. Per chunk: cumulative log-decay A_cum and the intra-chunk decay matrix L = exp(segsum).
    3. Diagonal blocks: y_diag = (C B^T * L) (dt x).
    4. Chunk states: the state each chunk produces from zero.
    5. Inter-chunk recurrence (associative scan) -> the state entering every chunk.
    6. Off-diagonal blocks: y_off = C S_in * exp(A_cum);  y = y_diag + y_off + D x.
    """
    b, t, h, p = x.shape
    g, n = B.shape[-2:]
    rep = h // g
    l = chunk_size
    pad = (-t) % l
    f32 = jnp.float32
    x, dt, B, C = (jnp.pad(v.astype(f32), [(0, 0), (0, pad)] + [(0, 0)] * (v.ndim - 2))
                   for v in (x, dt, B, C))
    c = (t + pad) // l
    B = jnp.repeat(B, rep, axis=2).reshape(b, c, l, h, n)
    C = jnp.repeat(C, rep, axis=2).reshape(b, c, l, h, n)
    xdt = (x * dt[..., None]).reshape(b, c, l, h, p)
    a = (A.astype(f32) * dt).reshape(b, c, l, h).transpose(0, 1, 3, 2)  # [b, c, h, l]
    a_cum = jnp.cumsum(a, axis=-1)

    hi = jax.lax.Precision.HIGHEST
    L = jnp.exp(segsum(a))  # [b, c, h, l, s]
    scores = jnp.einsum("bclhn,bcshn->bchls", C, B, precision=hi) * L
    y_diag = jnp.einsum("bchls,bcshp->bclhp", scores, xdt, precision=hi)

    # Decay from each position to the chunk's end: the last row of L (exact segsum),
    # not exp(a_cum[-1] - a_cum), which cancels catastrophically when a_cum is large.
    decay_to_end = L[..., -1, :]  # [b, c, h, l]
    chunk_states = jnp.einsum("bclhn,bchl,bclhp->bchpn", B, decay_to_end, xdt, precision=hi)

    init = jnp.zeros((b, h, p, n), f32) if initial_state is None else initial_state.astype(f32)
    states = _chunk_state_scan(jnp.exp(a_cum[..., -1]), chunk_states, init)
    y_off = jnp.einsum("bclhn,bchpn,bchl->bclhp", C, states[:, :-1], jnp.exp(a_cum),
                       precision=hi)

    y = (y_diag + y_off).reshape(b, c * l, h, p)[:, :t]
    y = y + D.astype(f32)[:, None] * x[:, :t]
    return y, states[:, -1]
