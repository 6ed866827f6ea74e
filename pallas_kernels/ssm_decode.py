"""Mamba2 decode: one token per sequence updates its slot's SSM state in place.

    h   = exp(dt * A) h + dt * x (outer) B        state [p, n] per (sequence, head)
    y   = h . C + D x     (times silu(z) if z is given)

The kernel is purely bandwidth-bound: each program owns one (sequence, head,
block of p rows), reads that block of the state once and writes it once; no
dots. Programs are ordered so that consecutive ones walk one slot's contiguous
state (block of p fastest, then head, then sequence). States are f32 or bf16
in memory, f32 in arithmetic. The state buffer is aliased to the output, so a
caller that jits with donation updates it in place.

This module knows nothing of how slots are allocated: slot_ids index the state
buffer directly (slot 0 is the dummy for padded rows). `ssm_decode` skips a row whose
slot id is negative: its state is neither read nor written and its y is unspecified
(a mixed step's rows that the chunked scan serves instead: hybrid_jax/ragged.py).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.backend import Impl, resolve_impl
from pallas_kernels.conv1d import conv1d_decode, decode_window
from pallas_kernels.horizontal import Deferred, Part, launch_parts
from pallas_kernels.launch import channel_block, is_pow2, launch
from pallas_kernels.ssm_common import check_mamba_args, effective_dt, silu

# Tuned on H100 (docs/history/benchmarks-2026.md, "SSM kernels"), by state dtype:
# keyword arguments of `_decode_pallas`. The grid order "phs" (consecutive programs
# walk one slot's contiguous state) took f32 from ~525 to ~490 us; evict_first on the
# state load/store helps bf16 (273 -> 259 us), not f32.
DECODE_TUNING = {
    "float32": dict(block_p=32, num_warps=4, order="phs"),
    "bfloat16": dict(block_p=32, num_warps=4, order="phs", evict="evict_first"),
}


class Packed(NamedTuple):
    """Where `ssm_decode_packed` finds its inputs (static: part of the jit key)."""

    head_dim: int  # p
    width: int  # h * p: x's columns in the xBC row; B follows, then C
    gn: int  # g * n: columns of B (and of C)
    n: int  # state dim
    dt_col0: int  # the raw dt's first column in the in_proj row
    dt_limit: tuple[float, float]
    conv: int = 0  # taps k: x, B and C are the raw xBC row, convolved here (0: already)
    xbc_col0: int = 0  # with conv: the raw xBC's first column in the in_proj row
    conv_bias: bool = False


def ssm_decode(
    x, dt, A, B, C, D, dt_bias, states, slot_ids, *,
    z=None, dt_limit=(0.0, float("inf")), impl: Impl | None = None,
):
    """One Mamba2 recurrence step per sequence.

    x [b, h, p]; dt [b, h] raw; A [h] (negative); B, C [b, g, n]; D, dt_bias [h];
    states [num_slots, h, p, n] f32 or bf16; slot_ids int [b] (negative: row skipped, its
    y unspecified); z [b, h, p] or None.
    Returns (y [b, h, p] in x.dtype, states with rows slot_ids updated).
    """
    impl = resolve_impl(impl)
    check_mamba_args(x, dt, A, B, C, D, dt_bias, states, slot_ids, z, dt_limit)
    if impl == "reference":
        return ssm_decode_reference(
            x, dt, A, B, C, D, dt_bias, states, slot_ids, z=z,
            dt_limit=tuple(map(float, dt_limit)),
        )
    p, n = x.shape[2], B.shape[2]
    if not (is_pow2(p) and is_pow2(n)):
        raise ValueError(f"head dim {p=} and state dim {n=} must be powers of 2")
    dte = effective_dt(dt, dt_bias, dt_limit)
    tuning = dict(DECODE_TUNING[jnp.dtype(states.dtype).name])
    tuning["block_p"] = channel_block(p, tuning["block_p"])
    return _decode_pallas(
        x, dte, A, B, C, D, states, slot_ids.astype(jnp.int32), z, impl=impl, **tuning,
    )


@functools.partial(jax.jit, static_argnames=("dt_limit", "impl"))
def ssm_decode_reference(
    x, dt, A, B, C, D, dt_bias, states, slot_ids, *, z=None, dt_limit=(0.0, float("inf")),
    impl: Impl | None = None,
):
    """Pure-JAX reference, same signature and contract as `ssm_decode`."""
    del impl
    h, g = x.shape[1], B.shape[1]
    f32 = jnp.float32
    # 1. dt = clamp(softplus(dt + dt_bias)); per-head decay exp(dt A).
    dte = effective_dt(dt, dt_bias, dt_limit)  # [b, h]
    decay = jnp.exp(dte * A.astype(f32))
    # 2. Heads read their group's B and C.
    Bh = jnp.repeat(B.astype(f32), h // g, axis=1)  # [b, h, n]
    Ch = jnp.repeat(C.astype(f32), h // g, axis=1)
    # 3. h = exp(dt A) h + dt x (outer) B.
    s = states[jnp.maximum(slot_ids, 0)].astype(f32)  # [b, h, p, n]
    xf = x.astype(f32)
    s = decay[..., None, None] * s + (dte[..., None] * xf)[..., None] * Bh[:, :, None, :]
    # 4. y = h . C + D x, gated.
    y = jnp.einsum("bhpn,bhn->bhp", s, Ch, precision="highest") + D.astype(f32)[:, None] * xf
    if z is not None:
        y = y * silu(z.astype(f32))
    keep = jnp.where(slot_ids < 0, states.shape[0], slot_ids)  # skipped rows: dropped
    return y.astype(x.dtype), states.at[keep].set(s.astype(states.dtype), mode="drop")


def _decode_body(*refs, hpg: int, bp: int, hb: int, loops: int, order: str,
                 evict: str | None, gated: bool, packed: Packed | None = None, pids=None):
    """One program: heads [h0, h0 + hb) x rows [pb * loops * bp, + loops * bp) of one sequence.

    order "shp": grid (b, h / hb, p / rows), the sequence varies fastest across programs;
    "phs": grid (p / rows, h / hb, b), consecutive programs walk one slot's contiguous state.
    loops > 1 walks the rows in `loops` blocks of bp with a fori_loop (Triton may pipeline).
    `packed` (hb = 1): x, B and C are read from one activated xBC row [b, conv_dim], the raw
    dt from columns of the in_proj output, dt's softplus and A = -exp(A_log) are computed
    here (see `ssm_decode_packed`); with `packed.conv` they are convolved here from the raw
    xBC row (`conv1d.decode_window`), the program rolling its x channels' conv state. pids: the
    grid's program ids (`horizontal.Part`), else `pl.program_id`.
    """
    if pids is None:
        pids = tuple(pl.program_id(a) for a in range(3))
    if gated:
        slot_ref, dt_ref, a_ref, d_ref, x_ref, b_ref, c_ref, st_ref, z_ref, y_ref, st_out = refs
    elif packed is None:
        slot_ref, dt_ref, a_ref, d_ref, x_ref, b_ref, c_ref, st_ref, y_ref, st_out = refs
    elif not packed.conv:
        row_ref, slot_ref, dt_ref, a_ref, d_ref, bias_ref, x_ref, st_ref, y_ref, st_out = refs
    else:
        row_ref, slot_ref, dt_ref, a_ref, d_ref, bias_ref, w_ref, *rest = refs
        cb_ref = rest.pop(0) if packed.conv_bias else None
        cst_ref, st_ref, y_ref, st_out, cst_out = rest
    s, hp, pb = pids if order == "shp" else pids[::-1]
    h0 = hp * hb
    heads = pl.ds(h0, hb)
    slot = slot_ref[s]
    g = h0 // hpg  # hb divides hpg: every head of the program reads one group
    f32 = jnp.float32
    # Per-program values, read once: dt, decay, D per head; the group's B and C.
    if packed is None:
        dt = dt_ref[s, heads]  # [hb]
        decay = jnp.exp(dt * a_ref[heads])[:, None, None]
        bv = b_ref[s, g, :].astype(f32)[None, None, :]  # [1, 1, n]
        cv = c_ref[s, g, :].astype(f32)[None, None, :]
    else:
        width, gn, n = packed.width, packed.gn, packed.n
        lo, hi = packed.dt_limit
        r = row_ref[0]
        v = dt_ref[s, pl.ds(packed.dt_col0 + h0, hb)].astype(f32) + bias_ref[r, heads].astype(f32)
        dt = jnp.maximum(v, 0.0) + jnp.log(1.0 + jnp.exp(-jnp.abs(v)))  # softplus
        dt = jnp.minimum(jnp.maximum(dt, lo), hi)
        decay = jnp.exp(-dt * jnp.exp(a_ref[r, heads].astype(f32)))[:, None, None]
        if not packed.conv:  # else convolved below, once the state's load is issued
            bv = x_ref[s, pl.ds(width + g * n, n)].astype(f32)[None, None, :]
            cv = x_ref[s, pl.ds(width + gn + g * n, n)].astype(f32)[None, None, :]
    dv = (d_ref[heads] if packed is None else d_ref[r, heads].astype(f32))[:, None]

    def load_state(i):
        rows = pl.ds((pb * loops + i) * bp, bp)
        if evict is None:
            return st_ref[slot, heads, rows, :]
        return plgpu.load(st_ref.at[slot, heads, rows, :], eviction_policy=evict)

    # With the conv folded in (loops == 1), the state's load is issued before the conv's
    # small dependent loads and arithmetic, which then run under it.
    first = load_state(0) if packed is not None and packed.conv else None
    if first is not None:
        def activated(ch0, nch):  # conv1d_decode's output for xBC channels [ch0, + nch), as stored
            acc, window = decode_window(dt_ref, w_ref, cb_ref, cst_ref, s=s, row=r, slot=slot,
                                        ch0=ch0, nch=nch, k=packed.conv, col0=packed.xbc_col0)
            return silu(acc).astype(dt_ref.dtype).astype(f32), window
        bv = activated(width + g * n, n)[0][None, None, :]
        cv = activated(width + gn + g * n, n)[0][None, None, :]
        # This program's x channels are its own: it rolls their conv state in place.
        # B's and C's are read by every head's programs; mixer_merge rolls them later.
        xch = h0 * packed.head_dim + pb * loops * bp
        x_conv, window = activated(xch, bp)
        for i in range(packed.conv - 1):
            cst_out[slot * (packed.conv - 1) + i, pl.ds(xch, bp)] = window[i + 1].astype(cst_out.dtype)

    def step(i, carry):
        rows = pl.ds((pb * loops + i) * bp, bp)
        state = (first if first is not None else load_state(i)).astype(f32)  # [hb, bp, n]
        if packed is None:
            x = x_ref[s, heads, rows].astype(f32)  # [hb, bp]
        elif packed.conv:  # loops == 1 (decode_packed_part)
            x = x_conv[None, :]
        else:
            start = h0 * packed.head_dim + (pb * loops + i) * bp
            x = x_ref[s, pl.ds(start, bp)].astype(f32)[None, :]  # [1, bp]
        state = decay * state + (dt[:, None] * x)[:, :, None] * bv
        y = jnp.sum(state * cv, axis=2) + dv * x
        if gated:
            y = y * silu(z_ref[s, heads, rows].astype(f32))
        y_ref[s, heads, rows] = y.astype(y_ref.dtype)
        new = state.astype(st_out.dtype)
        if evict is None:
            st_out[slot, heads, rows, :] = new
        else:
            plgpu.store(st_out.at[slot, heads, rows, :], new, eviction_policy=evict)
        return carry

    def run():
        if loops == 1:
            step(0, 0)
        else:
            jax.lax.fori_loop(0, loops, step, 0)

    if packed is None:  # `ssm_decode`: a negative slot id skips the row
        pl.when(slot >= 0)(run)
    else:
        run()


@functools.partial(jax.jit, static_argnames=(
    "impl", "block_p", "num_warps", "num_stages", "heads", "loops", "order", "evict"))
def _decode_pallas(x, dte, A, B, C, D, states, slot_ids, z, *, impl, block_p, num_warps,
                   num_stages=None, heads=1, loops=1, order="shp", evict=None):
    """Launch knobs (defaults: the original kernel): rows of state per load `block_p`,
    `loops` such blocks per program, `heads` per program, grid `order`, `evict` policy
    for the state load and store, Triton `num_warps` / `num_stages`."""
    b, h, p = x.shape
    g = B.shape[1]
    if (h // g) % heads or p % (block_p * loops):
        raise ValueError(f"{heads=} must divide {h // g} heads per group and "
                         f"{block_p=} x {loops=} must divide {p=}")
    f32 = jnp.float32
    args = [slot_ids, dte, A.astype(f32), D.astype(f32), x, B, C, states]
    if z is not None:
        args.append(z)
    kernel = functools.partial(_decode_body, hpg=h // g, bp=block_p, hb=heads, loops=loops,
                               order=order, evict=evict, gated=z is not None)
    out_shape = [
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        jax.ShapeDtypeStruct(states.shape, states.dtype),
    ]
    nblk = p // (block_p * loops)
    grid = (b, h // heads, nblk) if order == "shp" else (nblk, h // heads, b)
    call = launch(
        kernel, impl=impl, grid=grid, out_shape=out_shape, aliases={7: 1},
        num_warps=num_warps, num_stages=num_stages, name="ssm_decode",
    )
    return call(*args)


def ssm_decode_packed(
    xbc, zxbcdt, A_log, D, dt_bias, states, slot_ids, *, num_heads: int, head_dim: int,
    n_groups: int, dt_col0: int, dt_limit=(0.0, float("inf")), impl: Impl | None = None,
    row: int | None = None, defer: bool = False, conv_weight=None, conv_bias=None,
    conv_states=None, xbc_col0: int | None = None,
):
    """`ssm_decode` reading its inputs where a Mamba2 layer has them, with no XLA glue.

    xbc [b, h * p + 2 * g * n]: the activated conv output (x, then B, then C);
    zxbcdt [b, >= dt_col0 + h]: the in_proj output, the raw dt in columns
    [dt_col0, dt_col0 + h); A_log [h] (A = -exp(A_log)); D, dt_bias [h]; states
    [num_slots, h, p, n]. Returns (y [b, h, p] in xbc.dtype, states updated), equal to
    `ssm_decode` on the split, activated inputs: the slices, dt's softplus and A are
    computed inside the kernel instead of by four to six small XLA kernels per layer.
    `row`: A_log, D and dt_bias are stacks [L, h] (every layer's, hybrid_jax/fusion.py),
    read at row `row` in place (slices would be copied before the custom call).
    defer: where the kernel would launch, return it as a `horizontal.Deferred` instead
    (`parallel_decode` launches it beside paged decode).

    The conv folded in: with `conv_states` [num_slots, k - 1, c] (c = h * p + 2 * g * n),
    xbc is None and the kernel convolves the raw xBC row, zxbcdt's columns [xbc_col0,
    xbc_col0 + c), as `conv1d_decode(..., activation="silu")` with `conv_weight` [c, k]
    and `conv_bias` [c] | None (stacks [L, c, k] / [L, c] read at `row`). Returns (y,
    states, conv_states) in which only the x channels [0, h * p) of the slots' conv
    states are rolled: B's and C's are read by every head's programs, so rolling them
    here would race; `decode_glue.mixer_merge(conv_states=...)` rolls them after. One
    launch less per layer.
    """
    impl = resolve_impl(impl)
    if row is not None and any(a.ndim != 2 or not 0 <= row < a.shape[0] for a in (A_log, D, dt_bias)):
        raise ValueError(f"{row=}: A_log {A_log.shape}, D {D.shape}, dt_bias {dt_bias.shape} "
                         "must be stacks [L > row, h]")
    b = zxbcdt.shape[0]
    h, p = num_heads, head_dim
    fold = conv_states is not None
    if fold:
        if xbc is not None or conv_weight is None or xbc_col0 is None:
            raise ValueError("conv_states (the conv folded in) takes xbc=None, conv_weight and xbc_col0")
        c = conv_states.shape[-1]
        w1 = conv_weight if row is None else jax.ShapeDtypeStruct(conv_weight.shape[1:], conv_weight.dtype)
        if w1.ndim != 2 or w1.shape[0] != c or conv_states.shape[1] != w1.shape[1] - 1 or (
                conv_bias is not None and conv_bias.shape != conv_weight.shape[:-1]):
            raise ValueError(f"conv_weight {conv_weight.shape} (row {row}), conv_bias "
                             f"{None if conv_bias is None else conv_bias.shape} and conv_states "
                             f"{conv_states.shape} must be [c, k], [c] and [slots, k - 1, c]")
        if zxbcdt.ndim != 2 or not 0 <= xbc_col0 <= zxbcdt.shape[1] - c:
            raise ValueError(f"{xbc_col0=}: columns [{xbc_col0}, {xbc_col0 + c}) outside "
                             f"zxbcdt {zxbcdt.shape}")
        xbc_view = jax.ShapeDtypeStruct((b, c), zxbcdt.dtype)
    else:
        xbc_view = xbc
    gn = (xbc_view.shape[1] - h * p) // 2
    if xbc_view.ndim != 2 or gn <= 0 or xbc_view.shape[1] != h * p + 2 * gn or gn % n_groups:
        raise ValueError(f"xbc.shape={tuple(xbc_view.shape)} must be [b, {h}*{p} + 2*g*n] with g={n_groups}")
    n = gn // n_groups
    if zxbcdt.ndim != 2 or zxbcdt.shape[0] != b or zxbcdt.shape[1] < dt_col0 + h:
        raise ValueError(f"{zxbcdt.shape=} must be [{b}, >= {dt_col0 + h}] (dt columns from {dt_col0=})")
    # The split views' shapes, checked as `ssm_decode` checks its arguments.
    view = lambda *shape: jax.ShapeDtypeStruct(shape, xbc_view.dtype)  # noqa: E731
    one = (lambda a: a) if row is None else (lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype))
    check_mamba_args(view(b, h, p), view(b, h), one(A_log), view(b, n_groups, n), view(b, n_groups, n),
                     one(D), one(dt_bias), states, slot_ids, None, dt_limit)
    if impl == "reference" or not (is_pow2(p) and is_pow2(n)):
        if fold:  # conv1d_decode, then its new conv states for the x channels only
            xbc, rolled = conv1d_decode(zxbcdt, conv_weight, conv_bias, conv_states, slot_ids,
                                        activation="silu", impl=impl, col0=xbc_col0, row=row)
            conv_states = jnp.concatenate([rolled[..., :h * p], conv_states[..., h * p:]], axis=-1)
        if row is not None:
            A_log, D, dt_bias = A_log[row], D[row], dt_bias[row]
        x = xbc[:, :h * p].reshape(b, h, p)
        B = xbc[:, h * p:h * p + gn].reshape(b, n_groups, n)
        C = xbc[:, h * p + gn:].reshape(b, n_groups, n)
        A = -jnp.exp(A_log.astype(jnp.float32))
        out = ssm_decode(x, zxbcdt[:, dt_col0:dt_col0 + h], A, B, C, D, dt_bias, states, slot_ids,
                         dt_limit=dt_limit, impl=impl)
        return (*out, conv_states) if fold else out
    tuning = dict(DECODE_TUNING[jnp.dtype(states.dtype).name])
    tuning["block_p"] = channel_block(p, tuning["block_p"])
    if row is None:  # one layer's [h] vectors: a stack of one (reshapes: no copies)
        A_log, D, dt_bias, row = A_log[None], D[None], dt_bias[None], 0
        if fold:
            conv_weight = conv_weight[None]
            conv_bias = None if conv_bias is None else conv_bias[None]
    k = conv_weight.shape[-1] if fold else 0
    packed = Packed(p, h * p, gn, n, dt_col0, tuple(map(float, dt_limit)), k, xbc_col0 or 0,
                    fold and conv_bias is not None)
    # The row is an operand, not part of the static key: every layer's call is one
    # function, lowered once per executable (cold start-up; decode_glue._row_arg).
    operands = (jnp.full((1,), row, jnp.int32), xbc, zxbcdt, A_log, D, dt_bias, states,
                slot_ids.astype(jnp.int32))
    if fold:
        flat = conv_states.reshape(-1, conv_states.shape[-1])  # row = slot * (k - 1) + i
        operands += (conv_weight, conv_bias, flat)
    finish = _finish_fold(conv_states.shape) if fold else tuple
    if defer:
        num_warps = tuning.pop("num_warps")
        return Deferred(PackedStatic(packed, **tuning), operands, num_warps, finish)
    return finish(_decode_packed_pallas(*operands, impl=impl, packed=packed, **tuning))


def _finish_fold(shape):
    return lambda out: (out[0], out[1], out[2].reshape(shape))


class PackedStatic(NamedTuple):
    """The static arguments of a packed decode launch (`decode_packed_part`)."""

    packed: Packed
    block_p: int
    order: str = "shp"
    evict: str | None = None

    @property
    def outputs(self) -> int:
        return 3 if self.packed.conv else 2


def decode_packed_part(row, xbc, zxbcdt, A_log, D, dt_bias, states, slot_ids, conv_weight=None,
                       conv_bias=None, conv_flat=None, *, packed, block_p, order="shp",
                       evict=None) -> Part:
    """The packed decode kernel as a `horizontal.Part`; outputs y [b, h, p], states (aliased)
    and, with the conv folded in (packed.conv), the flat conv states (aliased)."""
    b = zxbcdt.shape[0]
    h, p, n = states.shape[1], states.shape[2], states.shape[3]
    body = functools.partial(_decode_body, hpg=h // (packed.gn // n), bp=block_p, hb=1, loops=1,
                             order=order, evict=evict, gated=False, packed=packed)
    nblk = p // block_p
    out_shape = (jax.ShapeDtypeStruct((b, h, p), zxbcdt.dtype),
                 jax.ShapeDtypeStruct(states.shape, states.dtype))
    if packed.conv:
        operands = (row, slot_ids, zxbcdt, A_log, D, dt_bias, conv_weight) + (
            (conv_bias,) if packed.conv_bias else ()) + (conv_flat, states)
        out_shape += (jax.ShapeDtypeStruct(conv_flat.shape, conv_flat.dtype),)
        aliases = {len(operands) - 1: 1, len(operands) - 2: 2}
    else:
        operands = (row, slot_ids, zxbcdt, A_log, D, dt_bias, xbc, states)
        aliases = {7: 1}
    grid = (b, h, nblk) if order == "shp" else (nblk, h, b)
    return Part(body, grid, operands, (None,) * len(operands), out_shape, (None,) * len(out_shape),
                aliases)


@functools.partial(jax.jit, static_argnames=("impl", "packed", "block_p", "num_warps", "order", "evict"))
def _decode_packed_pallas(row, xbc, zxbcdt, A_log, D, dt_bias, states, slot_ids, conv_weight=None,
                          conv_bias=None, conv_flat=None, *, impl, packed, block_p, num_warps,
                          order="shp", evict=None):
    part = decode_packed_part(row, xbc, zxbcdt, A_log, D, dt_bias, states, slot_ids, conv_weight,
                              conv_bias, conv_flat, packed=packed, block_p=block_p, order=order,
                              evict=evict)
    return launch_parts((part,), impl=impl, num_warps=num_warps, num_stages=None, name="ssm_decode")
