"""Float64 numpy oracles for the SSM kernels: plain sequential loops over tokens.

Written from the math alone (never importing pallas_kernels), so that a shared
bug in a kernel and its reference cannot pass. Also the ragged-batch builder the
SSM tests share: lengths, permuted slots with dummy slot 0, NaN-poisoned states.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def softplus(v):
    return np.logaddexp(0.0, v)


def silu(v):
    return v / (1.0 + np.exp(-v))


@dataclass
class Ragged:
    """A ragged batch: cu [b+1], t tokens (with a padding tail), slots, has_initial."""

    cu: np.ndarray
    t: int
    slots: np.ndarray
    has_initial: np.ndarray
    num_slots: int


def make_ragged(rng, lens, pad_tail, num_slots, pad_seqs=1):
    """Sequences of `lens` (then `pad_seqs` empty ones on dummy slot 0) and a padding tail.

    Real sequences get distinct, shuffled slots in [1, num_slots); has_initial is
    mixed (the first sequence always True, the second always False).
    """
    lens = list(lens) + [0] * pad_seqs
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    real = len(lens) - pad_seqs
    slots = np.zeros(len(lens), np.int32)
    slots[:real] = rng.permutation(np.arange(1, num_slots))[:real]
    has_initial = rng.random(len(lens)) < 0.5
    has_initial[0], has_initial[min(1, real - 1)] = True, False
    has_initial[real:] = False
    return Ragged(cu, int(cu[-1]) + pad_tail, slots, has_initial, num_slots)


def poison_states(rng, rg: Ragged, shape, dtype):
    """Random rows for slots read with has_initial, NaN everywhere else."""
    states = np.full((rg.num_slots, *shape), np.nan, np.float32)
    for s, h in zip(rg.slots, rg.has_initial, strict=True):
        if h:
            states[s] = rng.standard_normal(shape)
    return states.astype(dtype)


def ssm_step(state, x, dt, A, B, C, D):
    """One Mamba2 step for all heads; state [h, p, n] (updated in place), returns y [h, p]."""
    h = x.shape[0]
    g = B.shape[0]
    y = np.empty_like(x)
    for i in range(h):
        gi = i // (h // g)
        state[i] = np.exp(dt[i] * A[i]) * state[i] + dt[i] * np.outer(x[i], B[gi])
        y[i] = state[i] @ C[gi] + D[i] * x[i]
    return y


def ssd_np(x, dt, A, B, C, D, dt_bias, rg: Ragged, states, z=None, dt_limit=(0.0, np.inf)):
    """Sequential SSD over a ragged batch; returns (y [t, h, p], states) in float64."""
    f = lambda a: np.asarray(a, np.float64)
    x, dt, B, C, z = f(x), f(dt), f(B), f(C), None if z is None else f(z)
    states = f(states).copy()
    y = np.zeros_like(x)
    for i in range(len(rg.cu) - 1):
        s = states[rg.slots[i]].copy() if rg.has_initial[i] else np.zeros(states.shape[1:])
        for tt in range(rg.cu[i], rg.cu[i + 1]):
            d = np.clip(softplus(dt[tt] + f(dt_bias)), *dt_limit)
            y[tt] = ssm_step(s, x[tt], d, f(A), B[tt], C[tt], f(D))
            if z is not None:
                y[tt] *= silu(z[tt])
        states[rg.slots[i]] = s
    return y, states


def selective_scan_np(x, dt, A, B, C, D, dt_bias, rg: Ragged, states, z=None):
    """Sequential Mamba1 selective scan (per-channel dt, A [c, n]) over a ragged batch;
    returns (y [t, c], states [num_slots, c, n]) in float64."""
    f = lambda a: np.asarray(a, np.float64)
    x, dt, A, B, C, D, dt_bias = map(f, (x, dt, A, B, C, D, dt_bias))
    states = f(states).copy()
    y = np.zeros_like(x)
    for i in range(len(rg.cu) - 1):
        s = states[rg.slots[i]].copy() if rg.has_initial[i] else np.zeros(states.shape[1:])
        for tt in range(rg.cu[i], rg.cu[i + 1]):
            d = softplus(dt[tt] + dt_bias)  # [c]
            s = np.exp(d[:, None] * A) * s + np.outer(d * x[tt], B[tt])  # every channel c
            y[tt] = s @ C[tt] + D * x[tt]
            if z is not None:
                y[tt] *= silu(f(z[tt]))
        states[rg.slots[i]] = s
    return y, states


def conv_np(x, weight, bias, rg: Ragged, states, activation):
    """Sequential causal depthwise conv; states [num_slots, k-1, c]; returns (y, states)."""
    x, weight, states = np.asarray(x, np.float64), np.asarray(weight, np.float64), np.asarray(
        states, np.float64
    ).copy()
    k = weight.shape[1]
    y = np.zeros_like(x)
    for i in range(len(rg.cu) - 1):
        hist = states[rg.slots[i]].copy() if rg.has_initial[i] else np.zeros(states.shape[1:])
        for tt in range(rg.cu[i], rg.cu[i + 1]):
            window = np.concatenate([hist, x[tt][None]])  # [k, c], oldest first
            v = (window * weight.T).sum(0) + (0.0 if bias is None else np.asarray(bias))
            y[tt] = silu(v) if activation == "silu" else v
            hist = window[1:]
        states[rg.slots[i]] = hist
    assert k >= 2
    return y, states


def scan_np(a, b, rg: Ragged, states):
    """Sequential h_t = a_t h_{t-1} + b_t; returns (h [t, c], states)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    states = np.asarray(states, np.float64).copy()
    out = np.zeros_like(b)
    for i in range(len(rg.cu) - 1):
        h = states[rg.slots[i]].copy() if rg.has_initial[i] else np.zeros(states.shape[1:])
        for tt in range(rg.cu[i], rg.cu[i + 1]):
            h = a[tt] * h + b[tt]
            out[tt] = h
        states[rg.slots[i]] = h
    return out, states


def split_batch(rng, rg: Ragged):
    """Cut every sequence at a random point: two ragged batches over the same slots.

    Returns (first, second, index of first-part tokens, index of second-part tokens)
    into the original token axis. The second call starts from the slot whenever the
    first call ran at least one token of that sequence. Each batch has 3 padding tokens.
    """
    lens = np.diff(rg.cu)
    cut = np.array([rng.integers(0, n + 1) for n in lens])
    idx1 = np.concatenate([np.arange(rg.cu[i], rg.cu[i] + cut[i]) for i in range(len(lens))])
    idx2 = np.concatenate([np.arange(rg.cu[i] + cut[i], rg.cu[i + 1]) for i in range(len(lens))])
    mk = lambda ls, hi: Ragged(
        np.concatenate([[0], np.cumsum(ls)]).astype(np.int32), int(np.sum(ls)) + 3, rg.slots, hi,
        rg.num_slots,
    )
    first = mk(cut, rg.has_initial.copy())
    second = mk(lens - cut, rg.has_initial | (cut > 0))
    return first, second, idx1.astype(np.int64), idx2.astype(np.int64)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))
