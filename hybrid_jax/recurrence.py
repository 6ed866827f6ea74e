"""Full-sequence causal depthwise conv1d and diagonal linear recurrence, pure JAX.

The references that the serving path's ragged, slot-indexed kernels are checked
against. No knowledge of slots or pages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_conv1d(x: jax.Array, weight: jax.Array, bias: jax.Array | None,
                  initial: jax.Array | None = None) -> jax.Array:
    """Causal depthwise conv.  x [b, t, c], weight [c, k], bias [c] -> y [b, t, c] (x's dtype).

    y_t = sum_j weight[:, j] * x_{t-k+1+j} + bias, with x_{<0} taken from `initial`
    [b, k-1, c] (oldest first) or zeros. Accumulates in f32.
    """
    k = weight.shape[-1]
    b, t, c = x.shape
    if initial is None:
        initial = jnp.zeros((b, k - 1, c), x.dtype)
    xp = jnp.concatenate([initial.astype(x.dtype), x], axis=1).astype(jnp.float32)
    w = weight.astype(jnp.float32)
    y = sum(xp[:, j:j + t] * w[:, j] for j in range(k))
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def linear_recurrence(a: jax.Array, b: jax.Array,
                      h0: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """h_t = a_t * h_{t-1} + b_t over axis 1, via lax.associative_scan, in f32.

    a, b [b, t, c]; h0 [b, c] or None (zeros) -> (h [b, t, c] f32, h_T [b, c] f32).
    """
    a = a.astype(jnp.float32)
    b = b.astype(jnp.float32)
    if h0 is not None:
        b = b.at[:, 0].add(a[:, 0] * h0.astype(jnp.float32))

    def combine(left, right):
        a_l, b_l = left
        a_r, b_r = right
        return a_l * a_r, a_r * b_l + b_r

    _, h = jax.lax.associative_scan(combine, (a, b), axis=1)
    return h, h[:, -1]
