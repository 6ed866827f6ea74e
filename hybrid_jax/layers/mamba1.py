"""The Mamba1 mixer (Mamba, Falcon-Mamba, Jamba's SSM layers).

Shapes: t tokens, d hidden, c = d_inner channels, n state size, r = dt_rank.

    in_proj(x) -> [xs (c) | z (c)]
    u = silu(causal_conv1d(xs) + conv_bias)
    x_proj(u) -> [dt (r) | B (n) | C (n)], each RMS-normalised where the architecture does
                 (Falcon-Mamba: no weights; Jamba: with weights; Mamba: not at all)
    dt = dt_proj(dt) (its bias is `dt_bias`, added with the softplus inside the scan)
    s_t = exp(softplus(dt_t + dt_bias) A) s_{t-1} + softplus(...) u_t B_t,  A = -exp(A_log) [c, n]
    y_t = (s_t . C_t + D u_t) * silu(z_t);  out_proj(y)

The pieces are methods so that the serving path (hybrid_jax/ragged.py) swaps the conv and
the scan for slot-indexed kernels (pallas_kernels/selective_scan.py) over the same
weights; `__call__` is the full-sequence reference, a plain sequential scan.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_jax.config import Mamba1Config
from hybrid_jax.layers.linear import Linear
from hybrid_jax.layers.norms import RMSNorm, _rms_normalize
from hybrid_jax.recurrence import causal_conv1d

F32 = jnp.float32


class Mamba1Mixer(nnx.Module):
    """x [b, t, d] -> [b, t, d]."""

    def __init__(self, dim: int, cfg: Mamba1Config, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        c, n = cfg.d_inner, cfg.state_size
        self.in_proj = Linear(dim, 2 * c, bias=cfg.proj_bias, dtype=dtype, rngs=rngs)
        self.conv_weight = nnx.Param(0.5 * jax.random.normal(rngs.params(), (c, cfg.conv_kernel), dtype))
        self.conv_bias = nnx.Param(jnp.zeros((c,), dtype)) if cfg.conv_bias else None
        self.x_proj = Linear(c, cfg.x_proj_width, bias=False, dtype=dtype, rngs=rngs)
        self.dt_proj = Linear(cfg.dt_rank, c, bias=False, dtype=dtype, rngs=rngs)
        self.dt_bias = nnx.Param(jnp.zeros((c,), F32))
        self.A_log = nnx.Param(jnp.log(jnp.broadcast_to(jnp.arange(1, n + 1, dtype=F32), (c, n))))
        self.D = nnx.Param(jnp.ones((c,), F32))
        self.out_proj = Linear(c, dim, bias=cfg.proj_bias, dtype=dtype, rngs=rngs)
        weighted = cfg.bcdt_norm == "weighted"

        def norm(width: int) -> RMSNorm | None:
            return RMSNorm(width, eps=cfg.norm_eps, offset=False, dtype=dtype) if weighted else None

        self.dt_norm, self.b_norm, self.c_norm = norm(cfg.dt_rank), norm(n), norm(n)
        self.cfg = cfg

    def branches(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [..., d] -> (xs [..., c] the conv's input, z [..., c] the gate)."""
        xs, z = jnp.split(self.in_proj(x), 2, axis=-1)
        return xs, z

    def conv_bias_value(self) -> jax.Array | None:
        return None if self.conv_bias is None else self.conv_bias[...]

    def _norm(self, v: jax.Array, norm: RMSNorm | None) -> jax.Array:
        if self.cfg.bcdt_norm == "none":
            return v
        if norm is None:  # Falcon-Mamba: RMS-normalised in f32, no weight
            return _rms_normalize(v, self.cfg.norm_eps).astype(v.dtype)
        return norm(v)

    def ssm_inputs(self, u: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Activated conv output u [..., c] -> (raw dt [..., c] (dt_proj without its bias),
        B [..., n], C [..., n])."""
        cfg = self.cfg
        dt, B, C = jnp.split(self.x_proj(u), [cfg.dt_rank, cfg.dt_rank + cfg.state_size], axis=-1)
        dt = self.dt_proj(self._norm(dt, self.dt_norm))
        return dt, self._norm(B, self.b_norm), self._norm(C, self.c_norm)

    def A(self) -> jax.Array:
        return -jnp.exp(self.A_log[...].astype(F32))

    def output(self, y: jax.Array, dtype: jnp.dtype) -> jax.Array:
        """Gated scan output y [..., c] -> [..., d]."""
        return self.out_proj(y.astype(dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        xs, z = self.branches(x)
        u = jax.nn.silu(causal_conv1d(xs, self.conv_weight[...], self.conv_bias_value())
                        .astype(F32)).astype(xs.dtype)
        dt, B, C = self.ssm_inputs(u)
        y = selective_scan(u, dt, self.A(), B, C, self.D[...], self.dt_bias[...], z)
        return self.output(y, x.dtype)


def selective_scan(u: jax.Array, dt: jax.Array, A: jax.Array, B: jax.Array, C: jax.Array,
                   D: jax.Array, dt_bias: jax.Array, z: jax.Array) -> jax.Array:
    """The full-sequence selective scan from a zero state, one token at a time (lax.scan).

    u, dt, z [b, t, c]; A [c, n]; B, C [b, t, n]; D, dt_bias [c] -> y [b, t, c] f32.
    """
    delta = jax.nn.softplus(dt.astype(F32) + dt_bias.astype(F32))

    def step(s, inputs):
        d_t, u_t, b_t, c_t = inputs  # [b, c], [b, c], [b, n], [b, n]
        s = jnp.exp(d_t[..., None] * A) * s + (d_t * u_t)[..., None] * b_t[:, None, :]
        return s, jnp.einsum("bcn,bn->bc", s, c_t, precision=jax.lax.Precision.HIGHEST)

    uf = u.astype(F32)
    s0 = jnp.zeros((u.shape[0], *A.shape), F32)
    seq = tuple(jnp.moveaxis(v, 1, 0) for v in (delta, uf, B.astype(F32), C.astype(F32)))
    _, y = jax.lax.scan(step, s0, seq)
    y = jnp.moveaxis(y, 0, 1) + D.astype(F32) * uf
    return y * jax.nn.silu(z.astype(F32))
