"""Pallas kernel for the gated delta rule over q >= 1 tokens per sequence (decode, verification).

Contract: `gated_delta.gated_delta_step`. One program per (block of bv state columns,
value head, sequence), consecutive programs walking one slot's contiguous state (the
column block fastest, as ssm_decode's "phs" order). A program reads its [dk, bv] block of
the state once, runs it through the q tokens,

    S <- e^g S;   S <- S + k (beta (v - S^T k))^T;   o = scale S^T q

(with a per-channel decay, KDA, g [b, n, hv, dk]: S <- diag(e^g) S, a [dk, 1] column of
factors; S^T k and S^T q are column sums: a column block needs no other block, and no dots: the
update is bandwidth-bound) and writes it once, in place (the state buffer is aliased to
the output; donate it at the jit boundary), or, with candidates, after each token into a
separate [q, b, hv, dk, dv] buffer. The state is rounded to the pool's dtype after every
token, where a token-by-token decode stores it, so a candidate equals a plain decode.

This module knows nothing of argument checking (`gated_delta.py` does it), models or
slot allocation (slot 0 is the dummy for padding).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.launch import channel_block, launch

# Not tuned on a GPU yet: ssm_decode's H100 choice for the same bytes per program
# (a [dk=128, 32] f32 block is 16 KiB, as Mamba2's [32, n=128]).
STEP_TUNING = {
    "float32": dict(block_v=32, num_warps=4),
    "bfloat16": dict(block_v=32, num_warps=4),
}


def gated_delta_step_pallas(q, k, v, g, beta, states, slot_ids, *, scale: float,
                            candidates: bool, impl, block_v: int | None = None,
                            num_warps: int | None = None):
    """Checked arguments in; (o [b, n, hv, dv], states or candidates) out."""
    tuning = STEP_TUNING[jnp.dtype(states.dtype).name]
    dv = v.shape[-1]
    bv = channel_block(dv, block_v or tuning["block_v"])
    return _step_jit(q, k, v, g.astype(jnp.float32), beta.astype(jnp.float32), states,
                     slot_ids.astype(jnp.int32), scale=scale, candidates=candidates, impl=impl,
                     bv=bv, num_warps=num_warps or tuning["num_warps"])


@functools.partial(jax.jit, static_argnames=("scale", "candidates", "impl", "bv", "num_warps"))
def _step_jit(q, k, v, g, beta, states, slot_ids, *, scale, candidates, impl, bv, num_warps):
    b, n, hk = q.shape[:3]
    hv, dv = v.shape[2:]
    dk = q.shape[3]
    kernel = functools.partial(_step_body, n=n, rep=hv // hk, bv=bv, scale=scale,
                               candidates=candidates, per_channel=g.ndim == 4)
    out_shape = [
        jax.ShapeDtypeStruct((b, n, hv, dv), v.dtype),
        jax.ShapeDtypeStruct((n, b, hv, dk, dv) if candidates else states.shape, states.dtype),
    ]
    return launch(
        kernel, impl=impl, grid=(dv // bv, hv, b), out_shape=out_shape,
        aliases=None if candidates else {6: 1}, num_warps=num_warps, name="gated_delta_step",
    )(slot_ids, g, beta, q, k, v, states)


def _step_body(slot_ref, g_ref, beta_ref, q_ref, k_ref, v_ref, st_ref, o_ref, st_out, *,
               n: int, rep: int, bv: int, scale: float, candidates: bool, per_channel: bool):
    """Columns [vb bv, (vb + 1) bv) of value head hd's state of sequence s, through n tokens."""
    vb, hd, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    f32 = jnp.float32
    slot, kh = slot_ref[s], hd // rep
    cols = pl.ds(vb * bv, bv)
    state = st_ref[slot, hd, :, cols].astype(f32)  # [dk, bv]
    for j in range(n):
        qj = q_ref[s, j, kh, :].astype(f32)[:, None]  # [dk, 1]
        kj = k_ref[s, j, kh, :].astype(f32)[:, None]
        if per_channel:  # KDA: one decay per key channel (row of the state)
            state = jnp.exp(g_ref[s, j, hd, :].astype(f32))[:, None] * state
        else:
            state = jnp.exp(g_ref[s, j, hd]) * state
        delta = (v_ref[s, j, hd, cols].astype(f32) - jnp.sum(state * kj, axis=0)) * beta_ref[s, j, hd]
        state = state + kj * delta[None, :]
        o_ref[s, j, hd, cols] = (scale * jnp.sum(state * qj, axis=0)).astype(o_ref.dtype)
        stored = state.astype(st_out.dtype)
        if candidates:  # a Python int index fails in interpret mode
            st_out[jnp.int32(j), s, hd, :, cols] = stored
        state = stored.astype(f32)
    if not candidates:
        st_out[slot, hd, :, cols] = stored
