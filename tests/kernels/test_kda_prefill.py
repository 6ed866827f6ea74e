"""KDA's Pallas prefill pipeline (`kda_prefill.py`, interpret mode on CPU, compiled on a GPU)
against a float64 numpy scan written here from the rule and the token-sequential reference.

Checked: ragged batches of sequences of different lengths (not multiples of the chunk,
empty, one token, several chunks) with mixed initial states on shuffled slots, a padding
tail (o = 0), untouched slots and slots read without has_initial poisoned with NaN; strong
decays (per-token log decays down to -30 on some channels: e^G of a chunk is far below
f32's range) without NaN / Inf; one prompt prefilled in two calls (the engine's prefill
chunks: the second from the slot the first left) equal to one call; bf16 inputs and
states; the Triton lowering of Kimi Linear's head dims (on CPU, lowering for CUDA); and
that the model runs the kernel only with HYBRID_JAX_KDA_KERNEL=1.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gated_delta import gated_delta_ragged, gated_delta_ragged_reference
from pallas_kernels.kda_prefill import kda_prefill_pallas

KERNEL_IMPL = "pallas" if jax.default_backend() == "gpu" else "interpret"
SCALE = 0.2


def numpy_rule(q, k, v, g, beta, s0):
    """float64 scan of one sequence: q, k [t, hk, dk]; v [t, hv, dv]; g [t, hv, dk];
    s0 [hv, dk, dv]. Per token: S <- diag(e^g) S; S += beta k (v - S^T k)^T; o = scale S^T q."""
    rep = v.shape[1] // q.shape[1]
    s = s0.astype(np.float64).copy()
    out = np.zeros(v.shape, np.float64)
    for i in range(v.shape[0]):
        for h in range(v.shape[1]):
            kk, qq = k[i, h // rep].astype(np.float64), q[i, h // rep].astype(np.float64)
            s[h] *= np.exp(g[i, h].astype(np.float64))[:, None]
            s[h] += np.outer(kk, beta[i, h] * (v[i, h] - s[h].T @ kk))
            out[i, h] = SCALE * s[h].T @ qq
    return out, s


def make_inputs(rng, t, hk, hv, dk, dv):
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = unit(rng.standard_normal((t, hk, dk))).astype(np.float32)
    k = unit(rng.standard_normal((t, hk, dk))).astype(np.float32)
    v = rng.standard_normal((t, hv, dv)).astype(np.float32)
    g = -rng.uniform(0.0, 0.5, (t, hv, dk))
    g[:, :, :3] = -rng.uniform(10.0, 30.0, (t, hv, 3))  # channels that forget at every token
    beta = rng.uniform(0.1, 1.0, (t, hv)).astype(np.float32)
    return q, k, v, g.astype(np.float32), beta


def ragged_case(rng, lens, pad, hk, hv, dk, dv, num_slots=8):
    """`lens` on shuffled slots (has_initial alternating), `pad` padding tokens; untouched
    slots and slots read without has_initial hold NaN. -> (inputs, cu, states, slots, has)."""
    t = sum(lens) + pad
    slots = rng.permutation(np.arange(1, num_slots))[:len(lens)].astype(np.int32)
    has = np.array([i % 2 == 0 for i in range(len(lens))])
    states = np.full((num_slots, hv, dk, dv), np.nan, np.float32)
    states[slots[has]] = rng.standard_normal((int(has.sum()), hv, dk, dv))
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return make_inputs(rng, t, hk, hv, dk, dv), cu, states, slots, has


def float64_want(x, cu, states, slots, has):
    want_o = np.zeros(x[2].shape)
    want_s = {}
    for i in range(len(slots)):
        a, e = cu[i], cu[i + 1]
        s0 = states[slots[i]] if has[i] else np.zeros(states.shape[1:])
        want_o[a:e], want_s[slots[i]] = numpy_rule(*(y[a:e] for y in x), s0)
    return want_o, want_s


def kernel(*args, chunk, **kw):
    return gated_delta_ragged(*map(jnp.asarray, args), scale=SCALE, chunk_size=chunk,
                              impl=KERNEL_IMPL, **kw)


@pytest.mark.parametrize("lens,pad,heads,chunk", [
    # Kimi's head dims (128) scaled down to 32; chunks of 64 (four 16-row sub-chunks):
    # two chunks and a tail, one token, an empty sequence, less than a chunk
    ([70, 1, 0, 33], 5, (2, 2, 32, 32), 64),
    # chunks of 16 (one sub-chunk), a value head pair per key head, dv != dk
    ([37, 16, 5, 40], 3, (1, 2, 16, 32), 16),
])
def test_kernel_matches_float64_and_the_sequential_reference(lens, pad, heads, chunk):
    x, cu, states, slots, has = ragged_case(np.random.default_rng(0), lens, pad, *heads)
    want_o, want_s = float64_want(x, cu, states, slots, has)
    o, s = kernel(*x, cu, states, slots, has, chunk=chunk)
    o, s = np.asarray(o), np.asarray(s)
    np.testing.assert_allclose(o, want_o, atol=2e-5, rtol=1e-4)
    for slot, w in want_s.items():
        np.testing.assert_allclose(s[slot], w, atol=2e-5, rtol=1e-4)
    assert np.isfinite(o).all()
    assert not o[cu[-1]:].any()  # padding rows: 0
    untouched = np.setdiff1d(np.arange(states.shape[0]), slots)
    assert np.isnan(s[untouched]).all()
    ref_o, ref_s = gated_delta_ragged_reference(*map(jnp.asarray, (*x, cu, states, slots, has)),
                                                scale=SCALE)
    np.testing.assert_allclose(o, np.asarray(ref_o), atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(s[slots], np.asarray(ref_s)[slots], atol=2e-5, rtol=1e-4)


def test_a_prompt_in_two_calls_continues_from_its_slot():
    """The engine's chunked prefill: 45 then 38 tokens of one prompt (neither a multiple
    of the chunk), the second call from the state the first left in the slot, beside
    another sequence; equals the whole prompt in float64."""
    rng = np.random.default_rng(1)
    hk = hv = 2
    dk = dv = 32
    n1, n2, other = 45, 38, 20
    x = make_inputs(rng, n1 + n2, hk, hv, dk, dv)
    y = make_inputs(rng, other, hk, hv, dk, dv)
    states = rng.standard_normal((4, hv, dk, dv)).astype(np.float32)
    want_o, want_s = numpy_rule(*x, states[2])
    first = [a[:n1] for a in x]
    o1, st = kernel(*first, np.array([0, n1], np.int32), states, np.array([2], np.int32),
                    np.array([True]), chunk=32)
    second = [np.concatenate([a[n1:], b]) for a, b in zip(x, y, strict=True)]
    o2, st = kernel(*second, np.array([0, n2, n2 + other], np.int32), st,
                    np.array([2, 3], np.int32), np.array([True, False]), chunk=32)
    o = np.concatenate([np.asarray(o1), np.asarray(o2)[:n2]])
    np.testing.assert_allclose(o, want_o, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(st[2]), want_s, atol=2e-5, rtol=1e-4)
    want_other_o, want_other_s = numpy_rule(*y, np.zeros_like(want_s))
    np.testing.assert_allclose(np.asarray(o2)[n2:], want_other_o, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(st[3]), want_other_s, atol=2e-5, rtol=1e-4)
    np.testing.assert_array_equal(np.asarray(st[1]), states[1])  # untouched


@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.bfloat16])
def test_bf16_inputs(state_dtype):
    """bf16 q, k, v (dots on bf16 operands, f32 accumulation) against the f32 reference on
    the same rounded inputs; a looser tolerance, relative to the largest value."""
    rng = np.random.default_rng(2)
    x, cu, states, slots, has = ragged_case(rng, [50, 19], 6, 2, 2, 32, 32)
    states = np.nan_to_num(states)  # the reference reads every slot it is given
    bf = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))  # noqa: E731
    q, k, v, g, beta = bf(x[0]), bf(x[1]), bf(x[2]), x[3], x[4]
    st = np.asarray(jnp.asarray(states, state_dtype).astype(jnp.float32))
    want_o, want_s = float64_want((q, k, v, g, beta), cu, st, slots, has)
    o, s = gated_delta_ragged(*(jnp.asarray(a, jnp.bfloat16) for a in (q, k, v)), jnp.asarray(g),
                              jnp.asarray(beta), jnp.asarray(cu), jnp.asarray(states, state_dtype),
                              jnp.asarray(slots), jnp.asarray(has), scale=SCALE, chunk_size=32,
                              impl=KERNEL_IMPL)
    assert o.dtype == jnp.bfloat16 and s.dtype == state_dtype
    err = lambda got, want: np.abs(np.asarray(got, np.float32) - want).max() / np.abs(want).max()  # noqa: E731
    assert err(o[:cu[-1]], want_o[:cu[-1]]) < 3e-2
    for slot, w in want_s.items():
        assert err(s[slot], w) < 3e-2


def test_lowers_to_triton():
    """Kimi Linear's head dims (dk = dv = 128, bf16) and a small f32 case lower for Triton:
    three launches (checked on CPU by lowering for CUDA; PTX compilation needs the GPU)."""
    pytest.importorskip("jax._src.lib.triton")
    spec = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)  # noqa: E731
    f32 = jnp.float32
    for t, b, h, d, chunk, dt in ((256, 2, 4, 128, 64, jnp.bfloat16), (64, 3, 2, 16, 16, f32)):
        args = (spec(t, h, d, dt=dt), spec(t, h, d, dt=dt), spec(t, h, d, dt=dt),
                spec(t, h, d, dt=f32), spec(t, h, dt=f32), spec(b + 1, dt=jnp.int32),
                spec(5, h, d, d, dt=f32), spec(b, dt=jnp.int32), spec(b, dt=jnp.bool_))
        f = jax.jit(functools.partial(kda_prefill_pallas, scale=0.1, chunk_size=chunk, impl="pallas"))
        text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 3


def test_the_model_runs_the_kernel_only_with_the_switch(monkeypatch):
    """HYBRID_JAX_KDA_KERNEL: KDA's prefill (a per-channel g) asks for the kernel (impl None,
    the process default) only with the switch and head dims it tiles; the layer's forward
    through the kernel (interpret mode) equals the pure-JAX chunked form."""
    from flax import nnx

    from hybrid_jax.config import GatedDeltaNetConfig
    from hybrid_jax.layers import gated_deltanet
    from hybrid_jax.layers.kda import KimiDeltaAttention

    g3, g2 = jnp.zeros((4, 2, 16)), jnp.zeros((4, 2))
    monkeypatch.setattr(gated_deltanet, "KDA_KERNEL", False)
    assert gated_deltanet.prefill_impl(g3, 16, 16) == "reference"
    assert gated_deltanet.prefill_impl(g2, 16, 16) is None  # Gated DeltaNet: unchanged
    monkeypatch.setattr(gated_deltanet, "KDA_KERNEL", True)
    assert gated_deltanet.prefill_impl(g3, 16, 32) is None
    assert gated_deltanet.prefill_impl(g3, 8, 16) == "reference"  # dims the kernel cannot tile

    cfg = GatedDeltaNetConfig(num_k_heads=2, num_v_heads=2, head_k_dim=16, head_v_dim=16,
                              chunk_size=16, kimi_delta=True)
    layer = KimiDeltaAttention(24, cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 21, 24)), jnp.float32)
    calls = []
    plain = gated_deltanet.gated_delta_ragged

    def recorded(*a, impl=None, **kw):
        calls.append(impl)
        return plain(*a, impl=KERNEL_IMPL if impl is None else impl, **kw)

    monkeypatch.setattr(gated_deltanet, "gated_delta_ragged", recorded)
    with_kernel = layer(x)
    monkeypatch.setattr(gated_deltanet, "KDA_KERNEL", False)
    without = layer(x)
    assert calls == [None, "reference"]
    np.testing.assert_allclose(np.asarray(with_kernel), np.asarray(without), atol=1e-5, rtol=1e-4)
