"""Attention layer against a float64 numpy reference: window, GQA, soft-cap, partial rotary."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_jax.config import AttentionConfig
from hybrid_jax.layers.attention import Attention


def rope_np(x, pos, rd, theta):
    inv = 1.0 / theta ** (np.arange(0, rd, 2) / rd)
    ang = pos[:, None] * inv  # [t, rd/2]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2, rest = x[..., :rd // 2], x[..., rd // 2:rd], x[..., rd:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


def attention_np(x, wq, wk, wv, wo, cfg: AttentionConfig, window):
    t = x.shape[0]
    h, k, e = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pos = np.arange(t, dtype=np.float64)
    q = rope_np((x @ wq).reshape(t, h, e), pos, cfg.rope_dim, cfg.rope_theta)
    kk = rope_np((x @ wk).reshape(t, k, e) * cfg.key_multiplier, pos, cfg.rope_dim, cfg.rope_theta)
    v = (x @ wv).reshape(t, k, e)
    out = np.zeros((t, h, e))
    for head in range(h):
        kv = head // (h // k)
        s = q[:, head] @ kk[:, kv].T * cfg.query_scale
        if cfg.softcap:
            s = cfg.softcap * np.tanh(s / cfg.softcap)
        i, j = np.meshgrid(np.arange(t), np.arange(t), indexing="ij")
        ok = (j <= i) & ((i - j < window) if window else True)
        s = np.where(ok, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[:, head] = (p / p.sum(-1, keepdims=True)) @ v[:, kv]
    return out.reshape(t, h * e) @ wo


@pytest.mark.parametrize("window", [None, 1, 5])
@pytest.mark.parametrize("cfg", [
    AttentionConfig(4, 2, 16),
    AttentionConfig(4, 1, 16, rotary_dim=8, softcap=5.0),
    AttentionConfig(2, 2, 8, key_multiplier=0.5, scale=0.3),
])
def test_attention_matches_numpy(cfg, window):
    layer = Attention(24, cfg, window, dtype=jnp.float32, rngs=nnx.Rngs(0))
    x = np.asarray(jax.random.normal(jax.random.key(1), (12, 24)), np.float64)
    got = np.asarray(layer(jnp.asarray(x[None], jnp.float32), jnp.arange(12)[None]))[0]
    w = lambda lin: np.asarray(lin.kernel[...], np.float64)
    want = attention_np(x, w(layer.q_proj), w(layer.k_proj), w(layer.v_proj), w(layer.o_proj),
                        cfg, window)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)
