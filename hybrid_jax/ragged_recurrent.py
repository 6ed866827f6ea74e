"""The recurrent mixers' serving paths over a ragged batch with slot-indexed state.

Mamba2, Mamba1, the RG-LRU, short convolutions and Gated DeltaNet, as `hybrid_jax/ragged.py`
(the layer driver, attention and the paged K/V) calls them: each reads its sequences'
conv and scan states from their slots (zero when `has_initial` is False) and writes the
final state back; `decode` is one token per sequence; `q` > 0 is speculative
verification, which keeps the state after each of the q positions (`Candidates`) instead
of writing it. Same modules and weights as the full-sequence forward.

Mamba2 verification runs the layer's whole recurrent core (conv, split, dt, SSM update)
for the q tokens as one fused kernel, `mamba2_step`, when its shapes allow (power-of-2
head and state dims). Decode (one token) keeps the separate conv and SSM kernels: on
the H100 the fused kernel plus its conv-state scatter measured ~0.1 ms per step slower
than conv1d_decode + ssm_decode (native-1b-parallel, batch 1 and 64; docs/history/benchmarks-2026.md);
`FUSED_MAMBA_DECODE` switches decode to it. Prefill uses the separate kernels. A mixed
step's one-token sequences with a state take the decode update beside the prompts'
chunked scan (`MIXED_DECODE_UPDATE`).

Mamba1 layers run the conv1d kernels and the selective-scan kernels
(`selective_scan_ragged` for prefill chunks, `selective_scan_step` for decode and, with
candidates, verification); Gated DeltaNet its chunked prefill and its step kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from configs import switches
from hybrid_jax.cache import (
    GDNState,
    Mamba1State,
    Mamba2State,
    RaggedBatch,
    RGLRUState,
    ShortConvState,
)
from hybrid_jax.layers.gated_deltanet import GatedDeltaNet, prefill_impl
from hybrid_jax.layers.mamba1 import Mamba1Mixer
from hybrid_jax.layers.mamba2 import Mamba2Mixer
from hybrid_jax.layers.rglru import RecurrentBlock
from hybrid_jax.layers.short_conv import ShortConv
from pallas_kernels import (
    conv1d_decode,
    conv1d_ragged,
    linear_scan_decode,
    linear_scan_ragged,
    mamba2_step,
    mamba2_step_fits,
    selective_scan_ragged,
    selective_scan_step,
    ssd_ragged,
    ssm_decode,
    ssm_decode_packed,
)
from pallas_kernels.gated_delta import gated_delta_ragged, gated_delta_step

# Mixed steps run their decodes' Mamba2 state updates with `ssm_decode` beside the chunked
# scan of the prompts (`mamba2`). HYBRID_JAX_MIXED_DECODE_UPDATE=0: every sequence scans.
MIXED_DECODE_UPDATE = switches.mixed_decode_update()


def positions(q: int, step: Callable, xs: tuple[jax.Array, ...], states: tuple[jax.Array, ...],
               slot_ids: jax.Array):
    """Run a one-token decode `step` over q positions per sequence (verification).

    xs: per-token inputs [t = b * q, ...] (sequence-major); states: full slot arrays.
    `step(x_j..., local_states, rows)` is a decode kernel call on the b gathered states.
    Returns (outputs [t, ...] per output of step, candidates: tuple of [q, b, ...], the
    state after each position). The slot arrays are not written.
    """
    b = slot_ids.shape[0]
    local = tuple(s[slot_ids] for s in states)
    rows = jnp.arange(b, dtype=jnp.int32)
    outs, cands = [], []
    for j in range(q):
        y, local = step(*(x.reshape(b, q, *x.shape[1:])[:, j] for x in xs), local, rows)
        outs.append(y)
        cands.append(local)
    out = jax.tree.map(lambda *ys: jnp.stack(ys, 1).reshape(b * q, *ys[0].shape[1:]), *outs)
    return out, tuple(jnp.stack(c) for c in zip(*cands, strict=True))


def conv_positions(x: jax.Array, w: jax.Array, bias: jax.Array | None, conv: jax.Array,
                    slot_ids: jax.Array, q: int) -> tuple[jax.Array, jax.Array]:
    """Causal depthwise conv (no activation) over q positions per sequence, in XLA.

    x [t = b * q, c] (sequence-major); w [c, k]; conv [num_slots, k-1, c] (not written).
    Returns (y [t, c] in x.dtype, candidates [q, b, k-1, c]: the conv state after each
    position). Rounds as q `conv1d_decode` calls would: past inputs as the state stores
    them (conv.dtype), the current input as given; `recurrence.causal_conv1d` (the
    full-sequence reference) rounds the state to the input dtype instead, hence not reused.
    """
    b, c = slot_ids.shape[0], x.shape[-1]
    k = w.shape[1]
    f32 = jnp.float32
    xs = x.reshape(b, q, c)
    seq = jnp.concatenate([conv[slot_ids], xs.astype(conv.dtype)], axis=1)  # [b, k-1+q, c]
    past, wf = seq.astype(f32), w.astype(f32)
    y = jnp.zeros((b, q, c), f32) if bias is None else jnp.broadcast_to(bias.astype(f32), (b, q, c))
    for i in range(k - 1):  # tap i of position j reads input j + i of `seq`
        y = y + wf[:, i] * past[:, i:i + q]
    y = y + wf[:, k - 1] * xs.astype(f32)
    cands = jnp.stack([seq[:, j + 1:j + k] for j in range(q)])
    return y.reshape(b * q, c).astype(x.dtype), cands


def scan_positions(a: jax.Array, x: jax.Array, states: jax.Array, slot_ids: jax.Array,
                    q: int) -> tuple[jax.Array, jax.Array]:
    """h_j = a_j h_{j-1} + x_j over q positions per sequence, in XLA (elementwise, unrolled).

    a, x [t = b * q, c]; states [num_slots, c] (not written). Returns (h [t, c] in x.dtype,
    candidates [q, b, c] in states.dtype); h is stored between positions as
    `linear_scan_decode` stores it.
    """
    b, c = slot_ids.shape[0], x.shape[-1]
    a, x = a.reshape(b, q, c).astype(jnp.float32), x.reshape(b, q, c)
    h, outs, cands = states[slot_ids], [], []
    for j in range(q):
        v = a[:, j] * h.astype(jnp.float32) + x[:, j].astype(jnp.float32)
        h = v.astype(states.dtype)
        outs.append(v.astype(x.dtype))
        cands.append(h)
    return jnp.stack(outs, 1).reshape(b * q, c), jnp.stack(cands)


# Decode through the fused kernel too (see the module doc: measured slower on the H100).
FUSED_MAMBA_DECODE = False


def _mamba2_in(layer: Mamba2Mixer, x: jax.Array | None, proj: jax.Array | None,
              col: int) -> tuple[jax.Array, int]:
    """(zxbcdt, c0): the layer's in_proj output (muP multipliers applied) in columns
    [c0, c0 + width) of zxbcdt. From x, or read in place from a fused layer's projection
    `proj` at column `col` (a copy when multipliers apply)."""
    cfg = layer.cfg
    if proj is None:
        return layer.projection(x), 0
    if cfg.in_proj_multipliers is None:
        return proj, col
    return layer.projection(None, raw=proj[..., col:col + cfg.in_proj_width]), 0


def _split_in(layer: Mamba2Mixer, zxbcdt: jax.Array, c0: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """z, xBC, raw dt from `_mamba2_in`'s columns."""
    cfg = layer.cfg
    at = (c0, c0 + cfg.d_inner, c0 + cfg.d_inner + cfg.conv_dim, c0 + cfg.in_proj_width)
    return tuple(zxbcdt[..., lo:hi] for lo, hi in zip(at, at[1:], strict=False))


def _mamba2_step(layer: Mamba2Mixer, zxbcdt: jax.Array, c0: int, dtype, batch: RaggedBatch,
                st: Mamba2State, q: int, finish: Callable) -> tuple[jax.Array, Mamba2State]:
    """Decode (q == 0: one token per sequence, slots advanced) or verification (q > 0:
    candidates) through the fused kernel; tokens are sequence-major, t = b * max(q, 1)."""
    cfg = layer.cfg
    z, xbc, dt = _split_in(layer, zxbcdt, c0)
    b, n = batch.slot_ids.shape[0], max(q, 1)
    y, conv, ssm = mamba2_step(
        xbc.reshape(b, n, -1), dt.reshape(b, n, -1), layer.param("conv_weight"),
        layer.conv_bias_value(), layer.A(), layer.param("D"), layer.param("dt_bias"), st.conv, st.ssm,
        batch.slot_ids, n_groups=cfg.n_groups, head_dim=cfg.head_dim, dt_limit=cfg.dt_limit,
        candidates=q > 0)
    return finish(y.reshape(b * n, cfg.num_heads, cfg.head_dim), z, dtype), Mamba2State(conv, ssm)


def mamba2_decode_args(layer: Mamba2Mixer, zxbcdt: jax.Array, c0: int, batch: RaggedBatch,
                       st: Mamba2State, fold: bool = False) -> tuple[dict, jax.Array | None]:
    """A decode step's conv (run here) -> (`ssm_decode_packed`'s arguments, the new conv
    states). The kernels read the in_proj output in place (no slices, no dt/A glue) and, in
    a fused model, their parameters at this layer's row of the stacks (no copies).
    fold: the SSM kernel runs the conv itself (no conv launch; conv states None here: the
    kernel returns them with B's and C's channels left for `mixer_merge` to roll)."""
    cfg = layer.cfg
    (w, row), (bias, _) = layer.stacked("conv_weight"), layer.stacked("conv_bias")
    args = dict(zxbcdt=zxbcdt, A_log=layer.stacked("A_log")[0], D=layer.stacked("D")[0],
                dt_bias=layer.stacked("dt_bias")[0], states=st.ssm, slot_ids=batch.slot_ids,
                num_heads=cfg.num_heads, head_dim=cfg.head_dim, n_groups=cfg.n_groups,
                dt_col0=c0 + cfg.d_inner + cfg.conv_dim, dt_limit=cfg.dt_limit, row=row)
    if fold:
        return dict(xbc=None, conv_weight=w, conv_bias=bias, conv_states=st.conv,
                    xbc_col0=c0 + cfg.d_inner, **args), None
    xbc, conv = conv1d_decode(zxbcdt, w, bias, st.conv, batch.slot_ids, activation="silu",
                              col0=c0 + cfg.d_inner, row=row)
    return dict(xbc=xbc, **args), conv


def mamba2(layer: Mamba2Mixer, x: jax.Array | None, batch: RaggedBatch, st: Mamba2State,
           decode: bool, q: int = 0, proj: jax.Array | None = None, col: int = 0,
           project_out: bool = True, raw: bool = False, fold: bool = False) -> tuple[jax.Array, Mamba2State]:
    """proj: a fused layer's projection, this layer's in_proj output in its columns
    [col, col + in_proj_width) (x unused). project_out False returns out_proj's input;
    raw True (a decode step, `_merged_decode`) the SSM output y [b, h, p] before the gated
    norm (z stays in proj); fold (with raw) the conv inside the state update, B's and C's
    conv states left for mixer_merge to roll (`_temporal`)."""
    cfg = layer.cfg
    dtype = (x if proj is None else proj).dtype
    zxbcdt, c0 = _mamba2_in(layer, x, proj, col)
    finish = layer.output if project_out else layer.gated
    if raw:
        finish = lambda y, z, dtype: y  # noqa: E731
    if (q or (decode and FUSED_MAMBA_DECODE)) and mamba2_step_fits(cfg.head_dim, cfg.state_size):
        return _mamba2_step(layer, zxbcdt, c0, dtype, batch, st, q, finish)
    if decode and not q:
        args, conv = mamba2_decode_args(layer, zxbcdt, c0, batch, st, fold=fold)
        y, ssm, *folded = ssm_decode_packed(**args)
        conv = folded[0] if folded else conv
        return finish(y, zxbcdt[..., c0:c0 + cfg.d_inner], dtype), Mamba2State(conv, ssm)
    w, bias = layer.param("conv_weight"), layer.conv_bias_value()
    z, xbc, dt = _split_in(layer, zxbcdt, c0)
    if q:  # shapes the fused kernel does not take: q one-token steps
        A, D, dt_bias = layer.A(), layer.param("D"), layer.param("dt_bias")

        def step(xbc_j, dt_j, local, rows):
            conv, ssm = local
            u, conv = conv1d_decode(xbc_j, w, bias, conv, rows, activation="silu")
            xs, B, C = layer.split_xbc(u)
            y, ssm = ssm_decode(xs, dt_j, A, B, C, D, dt_bias, ssm, rows, dt_limit=cfg.dt_limit)
            return y, (conv, ssm)

        y, cands = positions(q, step, (xbc, dt), (st.conv, st.ssm), batch.slot_ids)
        return finish(y, z, dtype), Mamba2State(*cands)
    xbc, conv = conv1d_ragged(xbc, w, bias, batch.cu_seqlens, st.conv, batch.slot_ids,
                              batch.has_initial, activation="silu")
    xs, B, C = layer.split_xbc(xbc)
    A, D, dt_bias = layer.A(), layer.param("D"), layer.param("dt_bias")
    single = None
    if MIXED_DECODE_UPDATE:
        # A mixed step's one-token sequences with a state (its decodes) take the decode
        # update, the chunked scan only the others: through the scan each would cost a
        # chunk's state traffic (chunk state, entering state, state pass), ~2.9 of a 6.95 ms
        # step with 32 decodes and a 16-token prompt on the H100 (benchmarks/mixed_step.py).
        cu = batch.cu_seqlens
        single = (cu[1:] - cu[:-1] == 1) & batch.has_initial
    y, ssm = ssd_ragged(xs, dt, A, B, C, D, dt_bias, batch.cu_seqlens, st.ssm, batch.slot_ids,
                        batch.has_initial, dt_limit=cfg.dt_limit, chunk_size=cfg.chunk_size,
                        active=None if single is None else ~single)
    if single is not None:
        t = xs.shape[0]
        row = jnp.minimum(batch.cu_seqlens[:-1], t - 1)  # each sequence's first token
        y1, ssm = ssm_decode(xs[row], dt[row], A, B[row], C[row], D, dt_bias, ssm,
                             jnp.where(single, batch.slot_ids, -1), dt_limit=cfg.dt_limit)
        y = y.at[jnp.where(single, row, t)].set(y1, mode="drop")
    return finish(y, z, dtype), Mamba2State(conv, ssm)


def rglru(layer: RecurrentBlock, x: jax.Array, batch: RaggedBatch, st: RGLRUState,
               decode: bool, q: int = 0) -> tuple[jax.Array, RGLRUState]:
    y, u = layer.branches(x)
    w, bias = layer.conv_weight[...], layer.conv_bias[...]
    if q:
        v, conv = conv_positions(u, w, bias, st.conv, batch.slot_ids, q)
        a, xt = layer.gates(v, batch.positions)
        h, hs = scan_positions(a, xt, st.h, batch.slot_ids, q)
        return layer.output(h, y), RGLRUState(conv, hs)
    if decode:
        u, conv = conv1d_decode(u, w, bias, st.conv, batch.slot_ids, activation=None)
    else:
        u, conv = conv1d_ragged(u, w, bias, batch.cu_seqlens, st.conv, batch.slot_ids,
                                       batch.has_initial, activation=None)
    a, xt = layer.gates(u, batch.positions)
    if decode:
        h, hs = linear_scan_decode(a, xt, st.h, batch.slot_ids)
    else:
        h, hs = linear_scan_ragged(a, xt, batch.cu_seqlens, st.h, batch.slot_ids,
                                               batch.has_initial)
    return layer.output(h, y), RGLRUState(conv, hs)


def short_conv(layer: ShortConv, x: jax.Array, batch: RaggedBatch, st: ShortConvState,
                decode: bool, q: int = 0) -> tuple[jax.Array, ShortConvState]:
    bx, C = layer.gates(x)
    w, bias = layer.conv_weight[...], layer.conv_bias_value()
    if q:
        y, conv = conv_positions(bx, w, bias, st.conv, batch.slot_ids, q)
        return layer.output(y, C), ShortConvState(conv)
    if decode:
        y, conv = conv1d_decode(bx, w, bias, st.conv, batch.slot_ids, activation=None)
    else:
        y, conv = conv1d_ragged(bx, w, bias, batch.cu_seqlens, st.conv, batch.slot_ids,
                                batch.has_initial, activation=None)
    return layer.output(y, C), ShortConvState(conv)


def mamba1(layer: Mamba1Mixer, x: jax.Array, batch: RaggedBatch, st: Mamba1State,
            decode: bool, q: int = 0) -> tuple[jax.Array, Mamba1State]:
    """A Mamba1 layer over the ragged tokens: conv and selective scan from the slots' states.
    q > 0 (verification): the conv in XLA over the q positions and the q-token scan kernel,
    both returning the state after each position (candidates [q, b, ...])."""
    xs, z = layer.branches(x)
    w, bias = layer.conv_weight[...], layer.conv_bias_value()
    A, D, dt_bias = layer.A(), layer.D[...], layer.dt_bias[...]
    if q or decode:
        n = max(q, 1)
        if q:  # the conv in f32, activated, then rounded once (as conv1d_decode does)
            v, conv = conv_positions(xs.astype(jnp.float32), w, bias, st.conv, batch.slot_ids, q)
            u = jax.nn.silu(v).astype(xs.dtype)
        else:
            u, conv = conv1d_decode(xs, w, bias, st.conv, batch.slot_ids, activation="silu")
        dt, B, C = layer.ssm_inputs(u)
        b = batch.slot_ids.shape[0]
        seq = lambda a: a.reshape(b, n, a.shape[-1])  # noqa: E731
        y, ssm = selective_scan_step(seq(u), seq(dt), A, seq(B), seq(C), D, dt_bias, st.ssm,
                                     batch.slot_ids, z=seq(z), candidates=q > 0)
        return layer.output(y.reshape(b * n, -1), x.dtype), Mamba1State(conv, ssm)
    u, conv = conv1d_ragged(xs, w, bias, batch.cu_seqlens, st.conv, batch.slot_ids,
                            batch.has_initial, activation="silu")
    dt, B, C = layer.ssm_inputs(u)
    y, ssm = selective_scan_ragged(u, dt, A, B, C, D, dt_bias, batch.cu_seqlens, st.ssm,
                                   batch.slot_ids, batch.has_initial, z=z)
    return layer.output(y, x.dtype), Mamba1State(conv, ssm)
def gated_deltanet(layer: GatedDeltaNet, x: jax.Array, batch: RaggedBatch, st: GDNState,
                    decode: bool, q: int = 0) -> tuple[jax.Array, GDNState]:
    """Gated DeltaNet (and KDA, layers/kda.py: the same path with a per-channel decay g
    [t, h, dk] from its `gates`) over the ragged tokens. Prefill: the ragged conv and rule kernels, each
    sequence from its slot's states (zero without `has_initial`) to its final ones. Decode:
    one-token conv and rule steps, slots advanced. Verification (q > 0): the conv as q
    one-token steps on the gathered states and the rule's q-token step, both keeping the
    state after each position (candidates [q, b, ...]) and leaving the slots alone."""
    cfg = layer.cfg
    qkv, z, b, a = layer.project(x)
    w = layer.conv_weight[...]
    g, beta = layer.gates(b, a)
    if q:
        def step(x_j, local, rows):
            y, conv = conv1d_decode(x_j, w, None, local[0], rows, activation="silu")
            return y, (conv,)

        qkv, (conv,) = positions(q, step, (qkv,), (st.conv,), batch.slot_ids)
    elif decode:
        qkv, conv = conv1d_decode(qkv, w, None, st.conv, batch.slot_ids, activation="silu")
    else:
        qkv, conv = conv1d_ragged(qkv, w, None, batch.cu_seqlens, st.conv, batch.slot_ids,
                                  batch.has_initial, activation="silu")
    qh, kh, vh = layer.split_qkv(qkv)
    if not (q or decode):
        o, ssm = gated_delta_ragged(qh, kh, vh, g, beta, batch.cu_seqlens, st.ssm, batch.slot_ids,
                                    batch.has_initial, scale=layer.scale, chunk_size=cfg.chunk_size,
                                    impl=prefill_impl(g, cfg.head_k_dim, cfg.head_v_dim))
        return layer.output(o, z), GDNState(conv, ssm)
    n, nb = max(q, 1), batch.slot_ids.shape[0]  # tokens are sequence-major: t = b * n
    seq = lambda y: y.reshape(nb, n, *y.shape[1:])  # noqa: E731
    o, ssm = gated_delta_step(seq(qh), seq(kh), seq(vh), seq(g), seq(beta), st.ssm, batch.slot_ids,
                              scale=layer.scale, candidates=q > 0)
    return layer.output(o.reshape(nb * n, *o.shape[2:]), z), GDNState(conv, ssm)
