"""The small steps between a decode layer's GEMMs, one launch each.

    add_rms_norm(h, delta, w)   -> (h + delta, rms_norm(h + delta) * w)   (delta: or its parts)
    mixer_merge(attn, y, proj, w) -> [attention heads | gated_rms_norm(y, z) * w]
                                     (and B's and C's conv states rolled, optionally)

In a decode step each of these was two to five XLA kernels of 1-3 us: the residual add
with its sum of squares, the norm's application; the merge of paged decode's split
partial results (two), the gated norm's sum and application, the concatenation before
the fused out-projection. On the H100 a decode step of a 24-layer hybrid ran ~9 such
kernels per layer at batch 1 (docs/history/benchmarks-2026.md, tenth pass). Each op
here is one Pallas launch of one program per (row) or per (row, head / norm group):
latency, not bandwidth, is what they cost, so they are written for few, short programs.

The norm weights are read at row `row` of a stack [L, d] of every layer's weights in
place (hybrid_jax/fusion.py stacks them): a per-layer slice of the step's packed
parameters would be copied before each custom call. The row is an operand (a constant of
the step), not a static, so that every layer calls the same function: one lowering per
executable instead of one per layer (cold start-up).

Statistics in f32; roundings as the model's modules (hybrid_jax/layers/norms.py): the
references below are those modules' arithmetic, written out.

This module knows nothing of models or scheduling.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.backend import Impl, resolve_impl
from pallas_kernels.launch import is_pow2, launch

f32 = jnp.float32


class DecodeParts(NamedTuple):
    """Paged decode's attention before its splits are merged (`paged_attention_decode_fused`
    with merge=False). m None: o is already merged, [b, kv heads, rows, e] in `dtype`.
    Else o [S, b, kv heads, rows, e] f32 and m, l [S, b, kv heads, rows] f32 (m in log2
    units), each split's partial softmax state. `group` query heads per KV head occupy
    the first rows; `dtype` is the K/V pools' dtype (the merged output is rounded to it)."""

    o: jax.Array
    m: jax.Array | None
    l: jax.Array | None  # noqa: E741
    group: int
    dtype: jnp.dtype

    @property
    def heads(self) -> int:
        return self.o.shape[-3] * self.group


def merge_parts_reference(parts: DecodeParts) -> jax.Array:
    """DecodeParts -> o [b, heads, e] in parts.dtype."""
    o = parts.o
    if parts.m is not None:
        m_all = jnp.max(parts.m, axis=0)
        w = jnp.exp2(parts.m - m_all[None])
        l_all = jnp.sum(parts.l * w, axis=0)
        o = jnp.sum(parts.o * w[..., None], axis=0) / jnp.where(l_all == 0.0, 1.0, l_all)[..., None]
    b, nk, _, e = o.shape
    return o.astype(parts.dtype)[:, :, :parts.group].reshape(b, nk * parts.group, e)


def _stack_row(w: jax.Array, row: int | None) -> jax.Array:
    return w if row is None else w[row]


def add_rms_norm_reference(h, delta, weight, *, eps: float, offset: bool, row: int | None = None):
    """(h + delta in h's dtype, RMSNorm of it in h's dtype): `Block._add` without post-norm,
    multiplier or f32 residual, then `RMSNorm` (offset: Gemma's (1 + w)). delta [S, b, d]:
    parts summed in f32 first (`Linear.partials`)."""
    if delta.ndim == 3:
        delta = jnp.sum(delta.astype(f32), axis=0)
    h = h + delta.astype(h.dtype)
    x = h.astype(f32)
    x_hat = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    w = _stack_row(weight, row)
    if offset:
        return h, (x_hat * (1.0 + w.astype(f32))).astype(h.dtype)
    return h, w * x_hat.astype(h.dtype)


def gated_norm_reference(y, z, weight, *, n_groups: int, eps: float, norm_before_gate: bool,
                         row: int | None = None):
    """`GatedRMSNorm`: y, z [b, d] -> [b, d] f32."""
    y = y.astype(f32)
    gate = jax.nn.silu(z.astype(f32))
    if not norm_before_gate:
        y = y * gate
    b, d = y.shape
    g = y.reshape(b, n_groups, d // n_groups)
    g = g * jax.lax.rsqrt(jnp.mean(g * g, axis=-1, keepdims=True) + eps)
    out = _stack_row(weight, row).astype(f32) * g.reshape(b, d)
    return out * gate if norm_before_gate else out


def mixer_merge_reference(parts: DecodeParts, y, proj, weight, *, z_col: int, n_groups: int,
                          eps: float, norm_before_gate: bool, row: int | None = None):
    """[attention heads merged | gated norm of the SSM output] in proj's dtype."""
    b, d = y.shape[0], y.shape[1] * y.shape[2]
    a = merge_parts_reference(parts).reshape(b, -1).astype(proj.dtype)
    m = gated_norm_reference(y.reshape(b, d), proj[:, z_col:z_col + d], weight, n_groups=n_groups,
                             eps=eps, norm_before_gate=norm_before_gate, row=row)
    return jnp.concatenate([a, m.astype(proj.dtype)], axis=-1)


# ----------------------------------------------------------------------------- kernels


def _rms(x, eps, n):
    return x * jax.lax.rsqrt(jnp.sum(x * x) / n + eps)


def _add_norm_kernel(row_ref, h_ref, d_ref, w_ref, h_out, n_out, *, eps: float, offset: bool,
                     parts: int):
    i, row = pl.program_id(0), row_ref[0]
    h = h_ref[i, :]
    if parts:
        delta = d_ref[0, i, :].astype(f32)
        for s in range(1, parts):
            delta = delta + d_ref[s, i, :].astype(f32)
    else:
        delta = d_ref[i, :]
    h = h + delta.astype(h.dtype)
    h_out[i, :] = h
    x_hat = _rms(h.astype(f32), eps, h.shape[0])
    w = w_ref[row, :].astype(f32)
    if offset:
        n_out[i, :] = (x_hat * (1.0 + w)).astype(n_out.dtype)
    else:
        n_out[i, :] = (w * x_hat.astype(n_out.dtype).astype(f32)).astype(n_out.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "offset", "impl"))
def _add_rms_norm(row, h, delta, weight, *, eps, offset, impl):
    kernel = functools.partial(_add_norm_kernel, eps=eps, offset=offset,
                               parts=delta.shape[0] if delta.ndim == 3 else 0)
    shape = jax.ShapeDtypeStruct(h.shape, h.dtype)
    return launch(kernel, impl=impl, grid=(h.shape[0],), out_shape=[shape, shape],
                  name="add_rms_norm")(row, h, delta, weight)


def _row_arg(row: int | None) -> jax.Array:
    """The stack row as an operand, not a static: every layer's call is then the same
    function, traced and lowered once per executable (a static row lowered the kernel
    once per layer: +27 s of cold start-up for native-1b-parallel's decode buckets)."""
    return jnp.full((1,), row or 0, jnp.int32)


def add_rms_norm(h: jax.Array, delta: jax.Array, weight: jax.Array, *, eps: float,
                 offset: bool = False, row: int | None = None, impl: Impl | None = None):
    """h, delta [b, d] -> (h + delta, RMSNorm(h + delta)), both in h's dtype, in one launch.

    delta may be parts [S, b, d] of a product (`Linear.partials`): summed in f32, then
    rounded to h's dtype and added. weight [d], or a stack [L, d] read at `row`. offset:
    Gemma's (1 + w) * x_hat in f32, else w * cast(x_hat) (hybrid_jax/layers/norms.RMSNorm)."""
    if h.ndim != 2 or delta.shape[-2:] != h.shape or delta.ndim not in (2, 3):
        raise ValueError(f"delta {delta.shape} must be [b, d] or [S, b, d] with h {h.shape} [b, d]")
    stack = weight if row is not None else weight[None]
    if stack.ndim != 2 or stack.shape[1] != h.shape[1] or not 0 <= (row or 0) < stack.shape[0]:
        raise ValueError(f"weight {weight.shape} with {row=} does not give a [{h.shape[1]}] row")
    impl = resolve_impl(impl)
    if impl == "reference" or not is_pow2(h.shape[1]) or h.shape[0] == 0:
        return add_rms_norm_reference(h, delta, weight, eps=eps, offset=offset, row=row)
    return _add_rms_norm(_row_arg(row), h, delta, stack, eps=float(eps), offset=bool(offset), impl=impl)


class _MergeShape(NamedTuple):
    splits: int  # 0: the attention is already merged
    group: int
    e: int
    heads: int
    d: int  # SSM channels
    n_groups: int
    z_col: int
    eps: float
    norm_before_gate: bool
    pool_dtype: str
    conv: int = 0  # taps k: roll the B and C channels' conv states (0: no conv states)
    xbc_col: int = 0  # the raw xBC's first column in proj
    gn: int = 0  # channels of B (and of C)


def _mixer_merge_kernel(row_ref, *refs, s: _MergeShape):
    cst_ref = cst_out = slot_ref = None
    if s.conv:
        *refs, slot_ref, cst_ref, out_ref, cst_out = refs
        refs = (*refs, out_ref)
    if s.splits:
        o_ref, m_ref, l_ref, y_ref, p_ref, w_ref, out_ref = refs
    else:
        o_ref, y_ref, p_ref, w_ref, out_ref = refs
    i, j = pl.program_id(0), pl.program_id(1)
    pool = jnp.dtype(s.pool_dtype)

    if s.conv:
        @pl.when(j == s.heads + s.n_groups)
        def _roll_bc():  # a program per row of its own: B's and C's conv states, after the SSM read them
            base, k = slot_ref[i] * (s.conv - 1), s.conv
            for c0 in (s.d, s.d + s.gn):
                cols = pl.ds(c0, s.gn)
                new = [cst_ref[base + r, cols] for r in range(1, k - 1)]  # all loads first
                new.append(p_ref[i, pl.ds(s.xbc_col + c0, s.gn)].astype(cst_out.dtype))
                for r, v in enumerate(new):
                    cst_out[base + r, cols] = v

    @pl.when(j < s.heads)
    def _attention():
        kv, r = j // s.group, j % s.group
        if s.splits:
            ms = [m_ref[x, i, kv, r] for x in range(s.splits)]
            m_all = functools.reduce(jnp.maximum, ms)
            l_all = jnp.zeros((), f32)
            o = jnp.zeros((s.e,), f32)
            for x in range(s.splits):
                w = jnp.exp2(ms[x] - m_all)
                l_all = l_all + l_ref[x, i, kv, r] * w
                o = o + o_ref[x, i, kv, r, :] * w
            o = (o / jnp.where(l_all == 0.0, 1.0, l_all)).astype(pool)
        else:
            o = o_ref[i, kv, r, :]
        out_ref[i, pl.ds(j * s.e, s.e)] = o.astype(out_ref.dtype)

    @pl.when((j >= s.heads) & (j < s.heads + s.n_groups))
    def _gated_norm():
        cg = s.d // s.n_groups
        c0 = (j - s.heads) * cg
        y = y_ref[i, pl.ds(c0, cg)].astype(f32)
        z = p_ref[i, pl.ds(s.z_col + c0, cg)].astype(f32)
        gate = z * jax.nn.sigmoid(z)
        if not s.norm_before_gate:
            y = y * gate
        out = w_ref[row_ref[0], pl.ds(c0, cg)].astype(f32) * _rms(y, s.eps, cg)
        if s.norm_before_gate:
            out = out * gate
        out_ref[i, pl.ds(s.heads * s.e + c0, cg)] = out.astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("shape", "impl"))
def _mixer_merge(row, att, y, proj, weight, conv=(), *, shape, impl):
    b = y.shape[0]
    out = [jax.ShapeDtypeStruct((b, shape.heads * shape.e + shape.d), proj.dtype)]
    args = (row, *att, y.reshape(b, shape.d), proj, weight)
    aliases = {}
    if conv:  # (slot_ids, conv states [slots, k - 1, c]) -> flat rows slot * (k - 1) + i
        slot_ids, states = conv
        flat = states.reshape(-1, states.shape[-1])
        args += (slot_ids.astype(jnp.int32), flat)
        out.append(jax.ShapeDtypeStruct(flat.shape, flat.dtype))
        aliases = {len(args) - 1: 1}
    kernel = functools.partial(_mixer_merge_kernel, s=shape)
    res = launch(kernel, impl=impl, grid=(b, shape.heads + shape.n_groups + bool(conv)), out_shape=out,
                 aliases=aliases, name="mixer_merge")(*args)
    return (res[0], res[1].reshape(conv[1].shape)) if conv else res[0]


def roll_bc_reference(conv_states, slot_ids, proj, *, d: int, xbc_col: int):
    """The slots' conv states with channels [d, c) (B and C) rolled by one, the new inputs
    proj's columns [xbc_col + d, xbc_col + c); channels [0, d) unchanged."""
    c = conv_states.shape[-1]
    old = conv_states[slot_ids, 1:, d:]
    new = jnp.concatenate([old, proj[:, None, xbc_col + d:xbc_col + c].astype(old.dtype)], axis=1)
    return conv_states.at[slot_ids, :, d:].set(new)


def mixer_merge(parts: DecodeParts, y: jax.Array, proj: jax.Array, weight: jax.Array, *,
                z_col: int, n_groups: int, eps: float, norm_before_gate: bool = False,
                row: int | None = None, impl: Impl | None = None, conv_states=None,
                slot_ids=None, xbc_col: int | None = None):
    """A parallel hybrid layer's decode outputs -> the fused out-projection's input, one launch.

    parts: the layer's paged decode attention (DecodeParts); y [b, h, p]: its Mamba2 SSM
    output; proj [b, W]: its fused input projection, the gate z in columns [z_col, z_col +
    h * p); weight [h * p] (or a stack [L, h * p] read at `row`): the gated norm's.
    Returns [b, heads * e + h * p] in proj's dtype: the attention heads merged (rounded
    to parts.dtype first, as the unfused path) and `GatedRMSNorm(y, z)` over `n_groups`
    groups. Programs: one per (row, attention head) and per (row, norm group), and one
    per row for the conv states if any.

    conv_states [slots, k - 1, c] (with slot_ids [b] and xbc_col, the raw xBC's first
    column in proj): the conv folded into the SSM update (`ssm_decode_packed(conv_states=
    ...)`) left the B and C channels [h * p, c) of the slots' conv states to roll here;
    returns (out, conv_states with them rolled).
    """
    b, nk, rows, e = parts.o.shape[-4:]
    if y.ndim != 3 or y.shape[0] != b or proj.ndim != 2 or proj.shape[0] != b:
        raise ValueError(f"y {y.shape} must be [{b}, h, p] and proj {proj.shape} [{b}, W]")
    d = y.shape[1] * y.shape[2]
    if not 0 <= z_col <= proj.shape[1] - d or d % n_groups or parts.group > rows:
        raise ValueError(f"{z_col=} + {d} channels outside proj {proj.shape}, or {n_groups=} "
                         f"does not divide them, or group {parts.group} > rows {rows}")
    stack = weight if row is not None else weight[None]
    if stack.ndim != 2 or stack.shape[1] != d or not 0 <= (row or 0) < stack.shape[0]:
        raise ValueError(f"weight {weight.shape} with {row=} does not give a [{d}] row")
    gn = 0
    if conv_states is not None:
        c = conv_states.shape[-1]
        gn = (c - d) // 2
        if (conv_states.ndim != 3 or conv_states.shape[1] < 1 or gn <= 0 or c != d + 2 * gn
                or slot_ids is None or slot_ids.shape != (b,) or xbc_col is None
                or not 0 <= xbc_col <= proj.shape[1] - c):
            raise ValueError(f"conv_states {conv_states.shape} must be [slots, k - 1, {d} + 2 * g * n], "
                             f"slot_ids [{b}], and {xbc_col=} + c columns inside proj {proj.shape}")
    impl = resolve_impl(impl)
    common = dict(z_col=z_col, n_groups=n_groups, eps=eps, norm_before_gate=norm_before_gate)
    if impl == "reference" or not (is_pow2(e) and is_pow2(d // n_groups)) or b == 0 or (
            gn and not is_pow2(gn)):
        out = mixer_merge_reference(parts, y, proj, weight, row=row, **common)
        if conv_states is None:
            return out
        return out, roll_bc_reference(conv_states, slot_ids, proj, d=d, xbc_col=xbc_col)
    k = 0 if conv_states is None else conv_states.shape[1] + 1
    shape = _MergeShape(0 if parts.m is None else parts.o.shape[0], parts.group, e, parts.heads,
                        d, n_groups, z_col, float(eps), bool(norm_before_gate),
                        jnp.dtype(parts.dtype).name, k, xbc_col or 0, gn)
    att = (parts.o,) if parts.m is None else (parts.o, parts.m, parts.l)
    conv = () if conv_states is None else (slot_ids, conv_states)
    return _mixer_merge(_row_arg(row), att, y, proj, stack, conv, shape=shape, impl=impl)
