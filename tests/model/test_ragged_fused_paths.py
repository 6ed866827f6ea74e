"""The serving path's fused decode/verification pieces equal the per-token kernels they replace.

`ragged_recurrent.mamba2` in decode (one token per sequence, slots advanced) and verification
(q candidates) runs `mamba2_step` (the Pallas kernel, interpret mode) and is compared
with the same layer through the unfused path (conv1d_decode -> split -> ssm_decode,
their references), forced by declaring the shapes unfit. The layer has two groups,
conv bias, Falcon-H1's muP multipliers and a dt limit, so the [x | B | C] channel
order, dt and the gate are the layer's own.

A decode step's attention from a fused projection (`paged_attention_decode_fused`: the
kernel in interpret mode) equals the same layer through project -> write_kv -> decode.

The RG-LRU / short-conv verification conv and scan (XLA over the q positions) equal
q one-token `conv1d_decode` / `linear_scan_decode` calls (`ragged_recurrent.positions`), bf16
conv states included (stored between positions as the decode calls store them).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_jax import ragged, ragged_recurrent
from hybrid_jax.cache import Mamba2State, RaggedBatch
from hybrid_jax.config import AttentionConfig, LayerSpec, Mamba2Config, MLPConfig, ModelConfig
from hybrid_jax.fusion import fuse_projections
from hybrid_jax.layers.mamba2 import Mamba2Mixer
from hybrid_jax.model import CausalLM
from pallas_kernels import (
    conv1d_decode,
    linear_scan_decode,
    mamba2_step,
    paged_attention_decode_fused,
)
from tests.model.test_ragged_forward import MAX_LEN, Harness, decode_after

DIM, SLOTS = 32, 6
CFG = Mamba2Config(4, 16, 16, n_groups=2, dt_limit=(0.0, 3.0),
                   in_proj_multipliers=(1.0, 0.5, 2.0, 1.5, 0.7))


def _layer() -> Mamba2Mixer:
    layer = Mamba2Mixer(DIM, CFG, dtype=jnp.float32, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    h, c = CFG.num_heads, CFG.conv_dim
    layer.conv_bias.value = jnp.asarray(0.3 * rng.standard_normal(c), jnp.float32)
    layer.dt_bias.value = jnp.asarray(rng.standard_normal(h), jnp.float32)
    layer.D.value = jnp.asarray(rng.standard_normal(h), jnp.float32)
    return layer


def _batch(slots: np.ndarray, t: int) -> RaggedBatch:
    """Only slot_ids matter to the Mamba2 decode/verify core; the rest is well-formed filler."""
    b = len(slots)
    zeros = jnp.zeros(t, jnp.int32)
    return RaggedBatch(zeros, zeros, jnp.arange(b + 1, dtype=jnp.int32) * (t // b),
                       jnp.ones(b, jnp.int32), jnp.asarray(slots), jnp.ones(b, bool), (), (),
                       jnp.arange(b, dtype=jnp.int32))


def _run(monkeypatch, fused: bool, x, slots, st, decode, q):
    with monkeypatch.context() as m:
        if fused:
            m.setattr(ragged_recurrent, "mamba2_step", functools.partial(mamba2_step, impl="interpret"))
            m.setattr(ragged_recurrent, "FUSED_MAMBA_DECODE", True)  # off by default: slower on the H100
        else:
            m.setattr(ragged_recurrent, "mamba2_step_fits", lambda *_: False)
        return ragged_recurrent.mamba2(_layer(), x, _batch(slots, x.shape[0]), st, decode, q)


@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("q", [0, 3])
def test_fused_equals_unfused(monkeypatch, state_dtype, q):
    rng = np.random.default_rng(q)
    slots = np.array([3, 1, 5, 0], np.int32)  # the last row is padding on dummy slot 0
    b = len(slots)
    k = CFG.conv_kernel
    st = Mamba2State(
        jnp.asarray(rng.standard_normal((SLOTS, k - 1, CFG.conv_dim)), jnp.float32),
        jnp.asarray(rng.standard_normal((SLOTS, CFG.num_heads, CFG.head_dim, CFG.state_size)),
                    state_dtype))
    x = jnp.asarray(rng.standard_normal((b * max(q, 1), DIM)), jnp.float32)
    got = _run(monkeypatch, True, x, slots, st, q == 0, q)
    want = _run(monkeypatch, False, x, slots, st, q == 0, q)
    tol = 1e-5 if state_dtype == jnp.float32 else 1e-2
    live = slice(None, -1) if q else slots[:-1]  # candidates are [q, b, ...]; slots by id
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        g, w = np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32))
        if g.ndim == 2:  # the layer output [t, d]: padding rows are not compared
            g, w = g[: (b - 1) * max(q, 1)], w[: (b - 1) * max(q, 1)]
        elif q:
            g, w = g[:, live], w[:, live]
        else:
            g, w = g[live], w[live]
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol)


@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.bfloat16])  # of the conv state
@pytest.mark.parametrize("with_bias", [True, False])
def test_conv_and_scan_positions_equal_decode_steps(state_dtype, with_bias):
    rng = np.random.default_rng(int(with_bias))
    q, c, k = 3, 24, 4
    slots = np.array([4, 2, 0], np.int32)
    b = len(slots)
    r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    x, w, bias = r(b * q, c), r(c, k), r(c) if with_bias else None
    conv, hs = r(SLOTS, k - 1, c).astype(state_dtype), r(SLOTS, c)  # scan states are f32
    a = jax.nn.sigmoid(r(b * q, c))

    def step(x_j, a_j, local, rows):
        conv_l, h_l = local
        v, conv_l = conv1d_decode(x_j, w, bias, conv_l, rows, activation=None)
        h, h_l = linear_scan_decode(a_j, v.astype(jnp.float32), h_l, rows)
        return (v, h), (conv_l, h_l)

    (want_v, want_h), (want_conv, want_hs) = ragged_recurrent.positions(
        q, step, (x, a), (conv, hs), jnp.asarray(slots))
    v, got_conv = ragged_recurrent.conv_positions(x, w, bias, conv, jnp.asarray(slots), q)
    h, got_hs = ragged_recurrent.scan_positions(a, v.astype(jnp.float32), hs, jnp.asarray(slots), q)
    for g, want in ((v, want_v), (got_conv, want_conv), (h, want_h), (got_hs, want_hs)):
        assert g.shape == want.shape and g.dtype == want.dtype
        np.testing.assert_allclose(np.asarray(g.astype(jnp.float32)),
                                   np.asarray(want.astype(jnp.float32)), rtol=1e-5, atol=1e-5)


def _attention_config(attention: AttentionConfig) -> ModelConfig:
    """Attention layers the fused decode takes (64-wide heads): a hybrid with a window,
    a global attention layer."""
    return ModelConfig(
        architecture="native", vocab_size=64, hidden_size=64,
        layers=(LayerSpec("hybrid", 6), LayerSpec("attention", None)), attention=attention,
        mamba2=Mamba2Config(4, 16, 16, n_groups=2, chunk_size=16), mlp=MLPConfig(64),
        max_position_embeddings=MAX_LEN)


@pytest.mark.parametrize("attention", [
    AttentionConfig(4, 2, 64),
    AttentionConfig(8, 1, 64, rotary_dim=32, key_multiplier=0.5, qkv_bias=True, softcap=20.0),
], ids=["gqa", "partial-rotary-key-multiplier"])
def test_fused_decode_attention_equals_unfused(monkeypatch, attention):
    """A fused model's decode steps through `paged_attention_decode_fused` (the kernel,
    interpret mode: RoPE and the K/V writes in one launch) give the logits of the same
    model through project -> write_kv -> paged_attention_decode, and the same pages."""
    model = fuse_projections(CausalLM(_attention_config(attention), rngs=nnx.Rngs(2)))
    prompts = [np.random.default_rng(n).integers(0, 64, n).tolist() for n in (3, 9, 14)]
    calls = []

    def kernel(*a, **kw):
        calls.append(1)
        return paged_attention_decode_fused(*a, **kw, impl="interpret")

    def serve(fused: bool):
        h = Harness(model, len(prompts), fresh=True)
        h.run(dict(enumerate(prompts)), decode=False)
        with monkeypatch.context() as m:
            m.setattr(ragged, "paged_attention_decode_fused", kernel)
            if not fused:
                m.setattr(ragged, "_fused_decode", lambda *_: False)
            logits = decode_after(h, prompts, MAX_LEN - 14 - 1)  # past the window of 6 and pages
        return logits, h.caches

    got, got_caches = serve(True)
    assert calls, "the fused decode was not taken"
    n_calls = len(calls)
    want, want_caches = serve(False)
    assert len(calls) == n_calls, "the unfused run called the fused decode"
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(jax.tree.leaves(got_caches.kv), jax.tree.leaves(want_caches.kv), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)
