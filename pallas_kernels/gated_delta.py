"""Gated DeltaNet's recurrence (the gated delta rule) over ragged prefill batches and decode steps.

Per sequence, per value head i (reading key head i // (hv // hk)), state S [dk, dv]:

    S_t = exp(g_t) S_{t-1}                           decay, g_t <= 0
    S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T         delta-rule write
    o_t = scale * S_t^T q_t

which is the rule `S_t = g_t S_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T` written in the
[dk, dv] orientation kept in the slot pools. q and k come in L2-normalised (the layer does
that), g is the log decay in float32, beta the write strength in (0, 1).

`gated_delta_ragged` runs a packed prefill batch (cu_seqlens [b+1], like `ssd_ragged`):
a sequence starts from its slot's state when has_initial, else from zero, and leaves its
final state in its slot; padding tokens get o = 0. `gated_delta_step` runs q >= 1
consecutive tokens per sequence (decode, q == 1, or speculative verification):
`candidates=False` advances the slots, `candidates=True` leaves them alone and returns the
state after EACH position, [q, b, hv, dk, dv], for the caller to choose from (as
`mamba2_step` does). The state is rounded to the pool's dtype after every token, exactly
where a token-by-token decode stores it, so a verified candidate equals a plain decode.

Kimi Delta Attention (KDA) is the same rule with a per-channel decay: g [..., hv, dk]
instead of [..., hv], S_t = diag(exp(g_t)) S_{t-1} then the same write. Both entry
points take either form (the sequential references broadcast a scalar decay over dk);
with a per-channel decay, prefill runs the pure-JAX chunked form of `kda_chunked.py` for
`impl="reference"` and the Pallas pipeline of `kda_prefill.py` for "pallas" / "interpret"
(the model asks for it on a GPU only with HYBRID_JAX_KDA_KERNEL=1: layers/gated_deltanet.py);
the decode / verification step takes the switch like the per-head one (the step kernel
takes either decay).

Both dispatch on the kernel switch. The references here are sequential scans (the
contract and the tests' oracle). `impl="reference"` runs the pure-JAX chunk (WY) form
for prefill (`gated_delta_chunked.py`, `kda_chunked.py`: t / 64 sequential steps instead
of t) and the sequential step; "pallas" / "interpret" run the Pallas kernels
(`gated_delta_prefill.py`, `kda_prefill.py`, `gated_delta_decode.py`).
This module knows nothing of models or of how slots are allocated (slot 0 is the dummy).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.backend import Impl, resolve_impl
from pallas_kernels.gated_delta_chunked import gated_delta_ragged_chunked
from pallas_kernels.gated_delta_decode import gated_delta_step_pallas
from pallas_kernels.gated_delta_prefill import gated_delta_prefill_pallas
from pallas_kernels.kda_chunked import kda_ragged_chunked
from pallas_kernels.kda_prefill import kda_prefill_pallas
from pallas_kernels.launch import is_pow2
from pallas_kernels.ragged import segments
from pallas_kernels.ssm_common import check_ragged

_HI = jax.lax.Precision.HIGHEST
STATE_DTYPES = ("float32", "bfloat16")


def _check_heads(q, k, v, g, beta, states):
    if q.shape != k.shape:
        raise ValueError(f"q {q.shape} and k {k.shape} must have the same shape")
    hk, dk = q.shape[-2:]
    hv, dv = v.shape[-2:]
    if q.shape[:-2] != v.shape[:-2]:
        raise ValueError(f"q {q.shape} and v {v.shape} must agree on the leading (token) axes")
    if hv % hk:
        raise ValueError(f"value heads {hv} must be a multiple of key heads {hk}")
    if g.shape not in (v.shape[:-1], (*v.shape[:-1], dk)) or beta.shape != v.shape[:-1]:
        raise ValueError(f"g {g.shape} must be {v.shape[:-1]} (per head) or "
                         f"{(*v.shape[:-1], dk)} (per channel), beta {beta.shape} {v.shape[:-1]}")
    if states.ndim != 4 or states.shape[1:] != (hv, dk, dv):
        raise ValueError(f"states {states.shape} must be [num_slots, {hv}, {dk}, {dv}]")
    if jnp.dtype(states.dtype).name not in STATE_DTYPES:
        raise ValueError(f"states dtype {states.dtype} must be one of {STATE_DTYPES}")


def _check_kernel_dims(q, v):
    dk, dv = q.shape[-1], v.shape[-1]
    if not (is_pow2(dk) and is_pow2(dv) and dk >= 16 and dv >= 16):
        raise ValueError(f"head dims dk={dk} and dv={dv} must be powers of 2 >= 16 for the "
                         "Pallas kernels (impl='reference' takes any)")


def _update(s, q, k, v, g, beta, scale):
    """One token for all heads: s [h, dk, dv] f32; q, k [h, dk]; v [h, dv]; beta [h];
    g [h] (per head) or [h, dk] (per channel, KDA)."""
    s = (jnp.exp(g)[:, :, None] if g.ndim == 2 else jnp.exp(g)[:, None, None]) * s
    kv = jnp.einsum("hkv,hk->hv", s, k, precision=_HI)
    delta = (v - kv) * beta[:, None]
    s = s + k[:, :, None] * delta[:, None, :]
    o = jnp.einsum("hkv,hk->hv", s, q, precision=_HI) * scale
    return s, o


def _expand(x, hv):
    """Key-head tensor [..., hk, dk] -> value heads [..., hv, dk] (head i reads i // rep)."""
    return jnp.repeat(x, hv // x.shape[-2], axis=-2)


def gated_delta_ragged(q, k, v, g, beta, cu_seqlens, states, slot_ids, has_initial, *,
                       scale: float, chunk_size: int = 64, impl: Impl | None = None):
    """Gated delta rule over a ragged packed batch; returns (o [t, hv, dv] in v.dtype, states).

    q, k [t, hk, dk] (L2-normalised); v [t, hv, dv]; g [t, hv] float32 log decay (or
    [t, hv, dk]: per channel, KDA); beta [t, hv]; cu_seqlens [b+1];
    states [num_slots, hv, dk, dv] f32 or bf16; slot_ids [b]; has_initial [b] bool.
    """
    impl = resolve_impl(impl)
    _check_heads(q, k, v, g, beta, states)
    check_ragged(cu_seqlens, slot_ids, has_initial)
    if q.ndim != 3:
        raise ValueError(f"q {q.shape} must be [t, hk, dk]")
    if not (is_pow2(chunk_size) and chunk_size >= 16):
        raise ValueError(f"{chunk_size=} must be a power of 2 >= 16")
    per_channel = g.ndim == 3  # KDA
    if impl == "reference":
        chunked = kda_ragged_chunked if per_channel else gated_delta_ragged_chunked
        return chunked(q, k, v, g, beta, cu_seqlens, states, slot_ids, has_initial,
                       scale=float(scale), chunk_size=chunk_size)
    _check_kernel_dims(q, v)
    if per_channel:
        return kda_prefill_pallas(q, k, v, g, beta, cu_seqlens, states, slot_ids, has_initial,
                                  scale=float(scale), chunk_size=chunk_size, impl=impl)
    return gated_delta_prefill_pallas(q, k, v, g, beta, cu_seqlens, states, slot_ids,
                                      has_initial, scale=float(scale), chunk_size=chunk_size,
                                      impl=impl)


@functools.partial(jax.jit, static_argnames=("scale",))
def gated_delta_ragged_reference(q, k, v, g, beta, cu_seqlens, states, slot_ids, has_initial, *,
                                 scale: float):
    """Token-sequential scan; the contract of `gated_delta_ragged`."""
    t, hv = v.shape[0], v.shape[1]
    b = slot_ids.shape[0]
    f32 = jnp.float32
    seq = segments(cu_seqlens, t).seq  # b for padding tokens
    init = jnp.where(has_initial[:, None, None, None], states[slot_ids].astype(f32), 0.0)
    carry = jnp.concatenate([init, jnp.zeros_like(init[:1])])  # row b: padding sink
    xs = (seq, _expand(q, hv).astype(f32), _expand(k, hv).astype(f32), v.astype(f32),
          g.astype(f32), beta.astype(f32))

    def body(carry, x):
        i, qi, ki, vi, gi, bi = x
        s, o = _update(carry[i], qi, ki, vi, gi, bi, scale)
        return carry.at[i].set(s), jnp.where(i < b, o, 0.0)

    carry, o = jax.lax.scan(body, carry, xs)
    states = states.at[slot_ids].set(carry[:b].astype(states.dtype))
    return o.astype(v.dtype), states


def gated_delta_step(q, k, v, g, beta, states, slot_ids, *, scale: float, candidates: bool,
                     impl: Impl | None = None):
    """q >= 1 consecutive tokens per sequence.

    q, k [b, n, hk, dk] (L2-normalised); v [b, n, hv, dv]; g, beta [b, n, hv] (g
    [b, n, hv, dk]: per channel, KDA);
    states [num_slots, hv, dk, dv]; slot_ids [b]. Returns o [b, n, hv, dv] in v.dtype and
      candidates=False: states with rows slot_ids advanced by the n tokens;
      candidates=True: the states after each position, [n, b, hv, dk, dv] in the pool's
      dtype; the pool is not written.
    """
    impl = resolve_impl(impl)
    _check_heads(q, k, v, g, beta, states)
    if q.ndim != 4:
        raise ValueError(f"q {q.shape} must be [b, n, hk, dk]")
    if slot_ids.shape != q.shape[:1]:
        raise ValueError(f"slot_ids {slot_ids.shape} must be [{q.shape[0]}]")
    if impl == "reference":
        return gated_delta_step_reference(q, k, v, g, beta, states, slot_ids,
                                          scale=float(scale), candidates=candidates)
    _check_kernel_dims(q, v)
    return gated_delta_step_pallas(q, k, v, g, beta, states, slot_ids, scale=float(scale),
                                   candidates=candidates, impl=impl)


@functools.partial(jax.jit, static_argnames=("scale", "candidates"))
def gated_delta_step_reference(q, k, v, g, beta, states, slot_ids, *, scale: float,
                               candidates: bool):
    """Position-sequential scan; the contract of `gated_delta_step`."""
    hv = v.shape[2]
    f32, sd = jnp.float32, states.dtype
    s0 = states[slot_ids].astype(f32)
    tm = lambda x: jnp.moveaxis(x.astype(f32), 1, 0)  # noqa: E731  [b, n, ...] -> [n, b, ...]
    xs = (tm(_expand(q, hv)), tm(_expand(k, hv)), tm(v), tm(g), tm(beta))

    def body(s, x):
        s, o = jax.vmap(lambda *a: _update(*a, scale))(s, *x)
        s = s.astype(sd).astype(f32)  # stored (and read back) in the pool's dtype per token
        return s, (o, s.astype(sd))

    s, (o, cand) = jax.lax.scan(body, s0, xs)
    o = jnp.moveaxis(o, 0, 1).astype(v.dtype)
    if candidates:
        return o, cand
    return o, states.at[slot_ids].set(s.astype(sd))
