"""The Mamba2 mixer (also Falcon-H1's SSM branch).

in_proj -> [z (d_inner) | xBC (d_inner + 2 g n) | dt (h)], optionally scaled by
Falcon-H1's muP vector (rebuilt from the config: it is not in checkpoints);
xBC = silu(causal_conv1d(xBC)); split into x, B, C; SSD with A = -exp(A_log),
dt = clamp(softplus(dt + dt_bias)), D skip; gated RMS norm (or y * silu(z));
out_proj. Pieces are methods so the serving path can swap the conv and the scan
for slot-indexed kernels while sharing the weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_jax.config import Mamba2Config
from hybrid_jax.layers.linear import Linear
from hybrid_jax.layers.norms import GatedRMSNorm
from hybrid_jax.recurrence import causal_conv1d
from hybrid_jax.ssd import process_dt, ssd_chunked


class Mamba2Mixer(nnx.Module):
    """x [b, t, d] -> [b, t, d]."""

    def __init__(self, dim: int, cfg: Mamba2Config, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        h, conv_dim = cfg.num_heads, cfg.conv_dim
        proj = cfg.d_inner + conv_dim + h
        self.in_proj = Linear(dim, proj, bias=cfg.in_proj_bias, dtype=dtype, rngs=rngs)
        key = rngs.params()
        self.conv_weight = nnx.Param(0.5 * jax.random.normal(key, (conv_dim, cfg.conv_kernel), dtype))
        self.conv_bias = nnx.Param(jnp.zeros((conv_dim,), dtype)) if cfg.conv_bias else None
        self.dt_bias = nnx.Param(jnp.zeros((h,), jnp.float32))
        self.A_log = nnx.Param(jnp.log(jnp.arange(1, h + 1, dtype=jnp.float32)))
        self.D = nnx.Param(jnp.ones((h,), jnp.float32))
        self.norm = (GatedRMSNorm(cfg.d_inner, n_groups=cfg.n_groups, eps=cfg.norm_eps,
                                  norm_before_gate=cfg.norm_before_gate, dtype=dtype)
                     if cfg.gated_norm else None)
        self.out_proj = Linear(cfg.d_inner, dim, bias=cfg.out_proj_bias, dtype=dtype, rngs=rngs)
        # A fused model (hybrid_jax/fusion.py) stacks A_log, D, dt_bias and the conv weight
        # and bias of all its Mamba2 layers, shared by them: this layer's row (None: its own).
        self.stack_row: int | None = None
        self.cfg = cfg

    def _mup_vector(self) -> jax.Array | None:
        m = self.cfg.in_proj_multipliers
        if m is None:
            return None
        cfg = self.cfg
        gn = cfg.n_groups * cfg.state_size
        sizes = (cfg.d_inner, cfg.d_inner, gn, gn, cfg.num_heads)
        return jnp.concatenate([jnp.full((s,), v, jnp.float32) for s, v in zip(sizes, m, strict=True)])

    def project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [..., d] -> z [..., d_inner], xBC [..., conv_dim], raw dt [..., h]."""
        cfg = self.cfg
        z, xbc, dt = jnp.split(self.projection(x), [cfg.d_inner, cfg.d_inner + cfg.conv_dim], axis=-1)
        return z, xbc, dt

    def projection(self, x: jax.Array | None, raw: jax.Array | None = None) -> jax.Array:
        """x [..., d] -> the unsplit in_proj output [..., d_inner + conv_dim + h] (z, xBC, dt).

        raw: in_proj(x) already computed (fused with other projections, hybrid_jax/fusion.py);
        x is unused then. The muP multipliers (if any) apply to it here.
        """
        zxbcdt = self.in_proj(x) if raw is None else raw
        mup = self._mup_vector()
        if mup is not None:
            zxbcdt = (zxbcdt * mup).astype(zxbcdt.dtype)
        return zxbcdt

    def split_xbc(self, xbc: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Activated xBC [..., conv_dim] -> x [..., h, p], B and C [..., g, n]."""
        cfg = self.cfg
        gn = cfg.n_groups * cfg.state_size
        x, B, C = jnp.split(xbc, [cfg.d_inner, cfg.d_inner + gn], axis=-1)
        lead = xbc.shape[:-1]
        return (x.reshape(*lead, cfg.num_heads, cfg.head_dim),
                B.reshape(*lead, cfg.n_groups, cfg.state_size),
                C.reshape(*lead, cfg.n_groups, cfg.state_size))

    def param(self, name: str) -> jax.Array | None:
        """This layer's A_log, D, dt_bias, conv_weight or conv_bias (None: absent bias)."""
        v = getattr(self, name)
        if v is None:
            return None
        return v[...] if self.stack_row is None else v[self.stack_row]

    def stacked(self, name: str) -> tuple[jax.Array | None, int | None]:
        """(array, row): the whole stack and this layer's row in it, or (own array, None);
        for kernels that read their row in place (`row=` of conv1d_decode, ssm_decode_packed)."""
        v = getattr(self, name)
        return (None if v is None else v[...]), self.stack_row

    def A(self) -> jax.Array:
        return -jnp.exp(self.param("A_log").astype(jnp.float32))

    def gated(self, y: jax.Array, z: jax.Array, dtype: jnp.dtype) -> jax.Array:
        """SSM output y [..., h, p] (f32) and gate z [..., d_inner] -> out_proj's input
        [..., d_inner] in `dtype`."""
        y = y.reshape(*y.shape[:-2], -1)
        if self.norm is not None:
            y = self.norm(y, z)
        else:
            y = y * jax.nn.silu(z.astype(jnp.float32))
        return y.astype(dtype)

    def output(self, y: jax.Array, z: jax.Array, dtype: jnp.dtype) -> jax.Array:
        """SSM output y [..., h, p] (f32) and gate z [..., d_inner] -> [..., d]."""
        return self.out_proj(self.gated(y, z, dtype))

    def conv_bias_value(self) -> jax.Array | None:
        return self.param("conv_bias")

    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        z, xbc, dt = self.project(x)
        xbc = jax.nn.silu(causal_conv1d(xbc, self.param("conv_weight"), self.conv_bias_value())
                          .astype(jnp.float32)).astype(xbc.dtype)
        xs, B, C = self.split_xbc(xbc)
        dt = process_dt(dt, self.param("dt_bias"), cfg.dt_limit)
        y, _ = ssd_chunked(xs, dt, self.A(), B, C, self.param("D"), chunk_size=cfg.chunk_size)
        return self.output(y, z, x.dtype)
