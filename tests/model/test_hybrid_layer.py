"""The parallel hybrid layer: with its SSM branch's out_proj zeroed it IS the SWA-only layer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybrid_jax.config import AttentionConfig, LayerSpec, Mamba2Config, MLPConfig, ModelConfig
from hybrid_jax.model import Block

WINDOW = 8


def config(kind: str) -> ModelConfig:
    return ModelConfig(architecture="native", vocab_size=64, hidden_size=32,
                       layers=(LayerSpec(kind, WINDOW),),
                       attention=AttentionConfig(4, 2, 8),
                       mamba2=Mamba2Config(4, 16, 8, chunk_size=8), mlp=MLPConfig(64))


def blocks() -> tuple[Block, Block]:
    hybrid = Block(config("hybrid"), LayerSpec("hybrid", WINDOW), dtype=jnp.float32,
                   rngs=nnx.Rngs(0))
    swa = Block(config("attention"), LayerSpec("attention", WINDOW), dtype=jnp.float32,
                rngs=nnx.Rngs(1))
    # The SWA-only layer gets the hybrid layer's norm, attention and MLP weights.
    swa.temporal_norm, swa.attention = hybrid.temporal_norm, hybrid.attention
    swa.mlp_norm, swa.mlp = hybrid.mlp_norm, hybrid.mlp
    return hybrid, swa


def inputs(t: int = 30) -> tuple[jax.Array, jax.Array]:
    x = jax.random.normal(jax.random.key(3), (2, t, 32))
    return x, jnp.broadcast_to(jnp.arange(t), (2, t))


def test_zeroed_ssm_branch_equals_swa_layer_exactly():
    hybrid, swa = blocks()
    hybrid.mamba.out_proj.kernel[...] = jnp.zeros_like(hybrid.mamba.out_proj.kernel[...])
    x, pos = inputs()
    np.testing.assert_array_equal(np.asarray(hybrid(x, pos)), np.asarray(swa(x, pos)))


def test_live_ssm_branch_changes_the_output():
    hybrid, swa = blocks()
    x, pos = inputs()
    diff = np.abs(np.asarray(hybrid(x, pos)) - np.asarray(swa(x, pos)))
    assert diff.max() > 1e-2


def test_ssm_branch_carries_context_beyond_the_window():
    """A token outside every window still changes the hybrid output (via the SSM), not SWA's."""
    hybrid, swa = blocks()
    # Slow decay (A = -0.05) so the SSM remembers position 0 at position 23.
    hybrid.mamba.A_log[...] = jnp.full_like(hybrid.mamba.A_log[...], np.log(0.05))
    x, pos = inputs(24)
    x2 = x.at[:, 0].add(1.0)  # position 0 is > WINDOW tokens before the last one
    last = slice(-1, None)
    swa_delta = np.abs(np.asarray(swa(x, pos)[:, last] - swa(x2, pos)[:, last])).max()
    hyb_delta = np.abs(np.asarray(hybrid(x, pos)[:, last] - hybrid(x2, pos)[:, last])).max()
    assert swa_delta == 0.0
    assert hyb_delta > 1e-3
