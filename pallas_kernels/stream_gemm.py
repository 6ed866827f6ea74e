"""Weight-streaming GEMM for decode on Hopper (Mosaic GPU): y = x @ w[rows].T, few rows of x.

    y[m, c] = sum_k x[m, k] w[row0 + c, k]        c < n; f32 accumulation (wgmma)

At decode sizes a projection is bound by reading its weight once, so this kernel is a
TMA stream of the weight through shared memory into the tensor cores:

- w is held [out, in] (`Linear.transposed`), possibly many layers' weights stacked by
  rows in one array [rows, k]; the kernel reads rows [row0, row0 + n) in place, so a
  decode step passes each stack whole (a slice of it would be copied before the custom
  call) and `row0` picks the layer. row0 is a kernel operand, not a static, so that
  every layer's call is the same kernel (compiled once per executable).
- Grid (n / tn, splits): CTA (j, s) owns output columns [j tn, (j + 1) tn) and the s-th
  of `splits` equal ranges of k, which it walks in tiles of tk through a ring of
  `stages` shared-memory buffers filled by TMA (`stages - 1` tiles in flight while one
  is multiplied).
- `swap` (default): the weight tile is wgmma's A operand (M = tn rows of w) and x's tile,
  transposed in place, its B operand (N = m), so m can be any multiple of 8 up to 256;
  the [tn, m] accumulator is stored transposed into the [m, tn] output tile. Without
  `swap`: x is A (m a multiple of 64) and the weight tile transposed is B.
- splits == 1: y [m, n] in `out_dtype` (default x's). splits > 1: f32 partial sums
  [splits, m, n] whose sum over axis 0 is y (the consumer sums them, e.g.
  pallas_kernels/decode_glue.add_rms_norm).
- `stream_glu`: a gated MLP's hidden activation from its fused gate/up kernel, whose
  rows are the gate's n rows then the up's n: CTA j streams gate rows j and up rows j
  side by side into two accumulators and writes

      h[m, c] = act(gate[m, c] * gate_multiplier) * up[m, c]     act = silu

  with gate, up and the activation rounded to the output dtype, as the unfused path
  rounds them (XLA's silu * up is then one launch and one [m, 2n] round trip less).

When tn does not divide n, the last tile reads rows past row0 + n (the next layer's,
or zeros past the array's end: TMA fills out-of-bounds reads with zeros); the kernel
writes a [.., m, ceil(n / tn) tn] output (Mosaic GPU's tiled stores need whole tiles)
whose first n columns are returned: a slice that XLA may copy (0.034 ms per decode step
for 24 layers' input projections on an H200), which is why the engine's launch rule
(`hybrid_jax/layers/linear.glu_config`) takes whole tiles only. TMA copies start on
8-row tiles: row0, and n in the gated form, must be multiples of 8 (`check`).

Mosaic GPU kernels run on Hopper GPUs only (jax 0.11.2 there); jax 0.10.2's GPU
interpret mode does not implement wgmma on transposed operands, so on CPU the reference
runs (`impl="reference"`), and tests/kernels/test_stream_gemm.py checks the kernel on a
GPU. This module knows nothing of models: hybrid_jax/layers/linear.py decides where it
is used.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

SMEM_BYTES = 227 * 1024  # H100 / H200: shared memory per block (opt-in maximum)


@dataclass(frozen=True)
class StreamConfig:
    tn: int = 128  # output columns (weight rows) per CTA: a multiple of 64
    tk: int = 128  # depth per pipeline step: a multiple of 64
    stages: int = 4  # shared-memory buffers in the ring
    splits: int = 1  # k ranges (f32 partial outputs when > 1)
    swap: bool = True  # weight tile as wgmma's A operand (module doc)


def smem_bytes(m: int, cfg: StreamConfig, out_itemsize: int, weights: int = 1) -> int:
    """Shared memory one CTA allocates: the ring of weight and x tiles and the output tile
    (`weights` weight tiles per stage: 2 for `stream_glu`)."""
    return cfg.stages * (weights * cfg.tn + m) * cfg.tk * 2 + m * cfg.tn * out_itemsize


def check(m: int, k: int, n: int, rows: int, row0: int, cfg: StreamConfig, out_itemsize: int,
          weights: int = 1) -> None:
    """ValueError naming what does not fit (shapes, alignment, shared memory)."""
    if cfg.tn % 64 or cfg.tk % 64:
        raise ValueError(f"tn={cfg.tn} and tk={cfg.tk} must be multiples of 64")
    if m % 8 or m > 256 or (not cfg.swap and m % 64):
        raise ValueError(f"m={m} rows must be a multiple of {8 if cfg.swap else 64} and <= 256")
    if k % (cfg.tk * cfg.splits):
        raise ValueError(f"k={k} must be a multiple of tk * splits = {cfg.tk * cfg.splits}")
    if row0 % 8 or (weights > 1 and n % 8):  # the weight tiles' TMA copies start on 8-row tiles
        raise ValueError(f"row0={row0}" + (f" and n={n}" if weights > 1 else "") + " must be multiples of 8")
    if row0 < 0 or row0 + weights * n > rows:
        raise ValueError(f"rows [{row0}, {row0 + weights * n}) outside the weight's {rows} rows")
    if cfg.splits > 1 and cfg.swap:  # Mosaic GPU found no layout for the transposed f32 store (H200)
        raise ValueError(f"splits={cfg.splits} needs swap=False (f32 partials are stored untransposed)")
    if cfg.stages < 2:
        raise ValueError(f"stages={cfg.stages} must be >= 2")
    if weights > 1 and cfg.splits != 1:
        raise ValueError(f"splits={cfg.splits}: the gated form needs whole sums (splits=1)")
    need = smem_bytes(m, cfg, out_itemsize, weights)
    if need > SMEM_BYTES:
        raise ValueError(f"{need} bytes of shared memory > {SMEM_BYTES}: lower stages, tn or tk")


def reference(x: jax.Array, w: jax.Array, row0: int, n: int, splits: int = 1,
              out_dtype=None) -> jax.Array:
    """XLA: the same products (f32 accumulation), y or the split partial sums."""
    wr = jax.lax.slice_in_dim(w, row0, row0 + n, axis=0)
    m, k = x.shape
    if splits == 1:
        y = jax.lax.dot_general(x.astype(w.dtype), wr, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)
        return y.astype(out_dtype or x.dtype)
    xs = x.astype(w.dtype).reshape(m, splits, k // splits)
    return jax.lax.dot_general(xs, wr.reshape(n, splits, k // splits), (((2,), (2,)), ((1,), (1,))),
                               preferred_element_type=jnp.float32)


def silu(g: jax.Array) -> jax.Array:
    """g * sigmoid(g), written with exp alone (what the kernel's registers support)."""
    return g * (1.0 / (1.0 + jnp.exp(-g)))


def reference_glu(x: jax.Array, w: jax.Array, row0: int, n: int, gate_multiplier: float = 1.0,
                  out_dtype=None) -> jax.Array:
    """XLA: silu(gate * gate_multiplier) * up from rows [row0, row0 + 2n) of w; gate, up and
    the activation each rounded to the output dtype (as the unfused path's ops round)."""
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    gu = reference(x, w, row0, 2 * n, out_dtype=out_dtype).astype(jnp.float32)
    gate, up = gu[:, :n], gu[:, n:]
    h = silu(gate * gate_multiplier).astype(out_dtype).astype(jnp.float32)
    return (h * up).astype(out_dtype)


def load_runtime() -> None:
    """Import Mosaic GPU, which points its custom calls at their runtime library: an
    executable holding this kernel, deserialized from the persistent store by a process
    that has not traced it, fails to load otherwise ("Symbols not found:
    mosaic_gpu_init_tma_desc", H100, jax 0.11.2) and is compiled again."""
    if jax.default_backend() == "gpu":
        importlib.import_module("jax.experimental.mosaic.gpu")


def smem_transforms(cols: int, itemsize: int):
    """The tiling and swizzle of a shared-memory tile whose rows hold `cols` elements of
    `itemsize` bytes (the widest swizzle that divides a row), as TMA and wgmma take it."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    swizzle = 128
    while swizzle > 16 and cols * itemsize % swizzle:
        swizzle //= 2
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def stream_matmul(x: jax.Array, w: jax.Array, *, row0: int = 0, n: int | None = None,
                  cfg: StreamConfig = StreamConfig(), out_dtype=None,
                  impl: str = "pallas") -> jax.Array:
    """x [m, k] (bf16) times rows [row0, row0 + n) of w [rows, k] (bf16), transposed:
    y [m, n], or f32 partials [splits, m, n] (module doc). `impl="reference"`: XLA."""
    rows, k = w.shape
    n = rows - row0 if n is None else n
    m = x.shape[0]
    if x.shape[1] != k:
        raise ValueError(f"x {x.shape} and w {w.shape} differ in depth")
    out_dtype = jnp.dtype(jnp.float32 if cfg.splits > 1 else (out_dtype or x.dtype))
    if impl == "reference":
        return reference(x, w, row0, n, cfg.splits, out_dtype)
    check(m, k, n, rows, row0, cfg, out_dtype.itemsize)
    y = _kernel(x.astype(w.dtype), w, _row_operand(row0), n, cfg, out_dtype, None)
    return y[..., :n] if y.shape[-1] != n else y


def stream_glu(x: jax.Array, w: jax.Array, *, row0: int = 0, n: int, gate_multiplier: float = 1.0,
               cfg: StreamConfig = StreamConfig(), out_dtype=None, impl: str = "pallas") -> jax.Array:
    """A gated MLP's hidden activation h [m, n] = silu(gate * gate_multiplier) * up, where
    gate and up are x [m, k] times rows [row0, row0 + n) and [row0 + n, row0 + 2n) of
    w [rows, k], transposed (module doc). `impl="reference"`: XLA."""
    rows, k = w.shape
    m = x.shape[0]
    if x.shape[1] != k:
        raise ValueError(f"x {x.shape} and w {w.shape} differ in depth")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if impl == "reference":
        return reference_glu(x, w, row0, n, gate_multiplier, out_dtype)
    check(m, k, n, rows, row0, cfg, out_dtype.itemsize, weights=2)
    y = _kernel(x.astype(w.dtype), w, _row_operand(row0), n, cfg, out_dtype, float(gate_multiplier))
    return y[:, :n] if y.shape[-1] != n else y


def _row_operand(row0: int) -> jax.Array:
    """The first weight row as a kernel operand, not a static: every layer's call is then
    one kernel, lowered and compiled once per executable (a static row compiled it once
    per layer: cold start-up 44 -> 102 s on the H100)."""
    return jnp.full((1,), row0, jnp.int32)


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6))
def _kernel(x, w, row0, n: int, cfg: StreamConfig, out_dtype, glu: float | None):
    """row0 [1] int32: the first weight row. glu None: the plain product; else the gated
    form with this gate multiplier."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    m, k = x.shape
    tn, tk, stages, splits = cfg.tn, cfg.tk, cfg.stages, cfg.splits
    gated = glu is not None
    steps = k // (tk * splits)  # pipeline steps per CTA
    tiles = pl.cdiv(n, tn)
    in_tr = smem_transforms(tk, 2)
    out_tr = smem_transforms(tn, out_dtype.itemsize)
    acc_shape = (tn, m) if cfg.swap else (m, tn)

    def body(x_g, w_g, r_g, o_g, w_s, x_s, o_s, w_bar, x_bar, u_s=None, u_bar=None):
        j = jax.lax.axis_index("n")
        s = jax.lax.axis_index("s")
        k0 = s * (steps * tk)
        # This CTA's first weight row (check(): row0 and n are multiples of the 8-row tiling).
        first = pl.multiple_of(r_g[0] + j * tn, 8)

        def fetch(i, slot):
            kk = pl.ds(k0 + i * tk, tk)
            plgpu.copy_gmem_to_smem(w_g.at[pl.ds(first, tn), kk], w_s.at[slot], w_bar.at[slot])
            if gated:
                plgpu.copy_gmem_to_smem(w_g.at[pl.ds(pl.multiple_of(first + n, 8), tn), kk], u_s.at[slot],
                                        u_bar.at[slot])
            plgpu.copy_gmem_to_smem(x_g.at[:, kk], x_s.at[slot], x_bar.at[slot])

        for i in range(min(stages, steps)):
            fetch(i, i)

        def mma(acc, w_tile, x_tile):
            if cfg.swap:
                plgpu.wgmma(acc, w_tile, plgpu.transpose_ref(x_tile, (1, 0)))
            else:
                plgpu.wgmma(acc, x_tile, plgpu.transpose_ref(w_tile, (1, 0)))

        def scope(acc, acc_u):
            def step(i, carry):
                slot = jax.lax.rem(i, stages)
                plgpu.barrier_wait(w_bar.at[slot])
                plgpu.barrier_wait(x_bar.at[slot])
                mma(acc, w_s.at[slot], x_s.at[slot])
                if gated:
                    plgpu.barrier_wait(u_bar.at[slot])
                    mma(acc_u, u_s.at[slot], x_s.at[slot])
                plgpu.wgmma_wait(2 if gated else 1)  # step i - 1's wgmmas are done: its buffers are free
                nxt = i - 1 + stages

                @pl.when(jnp.logical_and(i >= 1, nxt < steps))
                def _():
                    fetch(nxt, jax.lax.rem(i - 1, stages))
                return carry

            jax.lax.fori_loop(0, steps, step, None)
            if not gated:
                return acc[...]
            # Rounded to the output dtype as the unfused GEMM's output is, then the gate.
            g = acc[...].astype(out_dtype).astype(jnp.float32) * glu
            u = acc_u[...].astype(out_dtype).astype(jnp.float32)
            h = silu(g).astype(out_dtype).astype(jnp.float32)
            return h * u

        accs = [plgpu.ACC(acc_shape, jnp.float32)] * 2
        acc = pl.run_scoped(lambda a, b: scope(a, b), *accs) if gated else \
            pl.run_scoped(lambda a: scope(a, None), accs[0])
        if cfg.swap:
            plgpu.transpose_ref(o_s, (1, 0))[...] = acc.astype(out_dtype)
        else:
            o_s[...] = acc.astype(out_dtype)
        plgpu.commit_smem()
        cols = pl.ds(j * tn, tn)
        plgpu.copy_smem_to_gmem(o_s, o_g.at[s, :, cols] if splits > 1 else o_g.at[:, cols])
        plgpu.wait_smem_to_gmem(0)

    # Mosaic GPU names the kernel after its body: profiler traces then show what runs.
    body.__name__ = "stream_glu" if gated else "stream_gemm"
    out_shape = (splits, m, tiles * tn) if splits > 1 else (m, tiles * tn)
    scratch = dict(
        w_s=plgpu.SMEM((stages, tn, tk), w.dtype, transforms=in_tr),
        x_s=plgpu.SMEM((stages, m, tk), x.dtype, transforms=in_tr),
        o_s=plgpu.SMEM((m, tn), out_dtype, transforms=out_tr),
        w_bar=plgpu.Barrier(num_barriers=stages),
        x_bar=plgpu.Barrier(num_barriers=stages),
    )
    if gated:  # the up rows' ring beside the gate's
        scratch.update(u_s=plgpu.SMEM((stages, tn, tk), w.dtype, transforms=in_tr),
                       u_bar=plgpu.Barrier(num_barriers=stages))
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
        scratch_types=scratch,
        grid=(tiles, splits),
        grid_names=("n", "s"),
    )(x, w, row0)
