"""Block-scaled FP8 GEMM for prefill on Hopper (Mosaic GPU): the Hub FP8 format's own product.

    y[m, c] = sum_b  xs[m, b] ws[c // 128, b]  sum_{k in block b} xq[m, k] wq[c, k]

- wq [n, k] float8_e4m3fn, ws [ceil(n/128), k/128] f32: a Linear's weight as the
  checkpoint stores it ([out, in], `Linear.transposed`) with one scale per 128 x 128 block.
- xq [m, k] e4m3, xs [m, k/128] f32: the activations quantized per token and 128-wide
  group, dynamically (`quantize_rows`), as the checkpoints' `activation_scheme: dynamic`
  with `weight_block_size: [128, 128]` specifies (DeepSeek-V3 and the Qwen3 / Qwen3.5 FP8
  releases; vLLM and SGLang serve them the same way).

The tensor cores multiply e4m3 by e4m3 (wgmma, f32 accumulation, twice bf16's rate); the
scales change every 128 of depth, so each 128-deep block's product is its own wgmma into a
fresh accumulator, which the CUDA cores scale and add to the running sum (a register
array): the "promotion" of DeepSeek's DeepGEMM, written here in Pallas.

- CTA: 128 rows of x by `tn` output columns (tn 128, the default, or 256: one weight scale
  per 128 columns per block; 128 where 256 does not divide n, so that the last tile, which
  may end past n, reads only existing scale rows; TMA reads the weight rows past n as
  zeros). Three warpgroups: two compute warpgroups (64 rows each) and one that only
  issues the TMA copies into a ring of `stages` (4) shared-memory buffers (x's e4m3 tile
  [128, 128], the weight's [tn, 128], x's 128 scales of that block), refilling a buffer
  once both compute warpgroups have arrived on its "consumed" barrier.
- Per block and per 128 columns: wgmma (A = x's 64 rows, B = the weight tile transposed,
  both K-major as e4m3 wgmma requires), then acc += part * (xs[rows] * ws[col block]).
- Grid (m / 128, ceil(n / tn)), rows fastest: consecutive CTAs share a weight tile.

`fp8_block_matmul` takes x in the compute dtype, quantizes it (an XLA fusion), pads rows to
a multiple of 128 and runs the kernel; `impl="reference"` is the same arithmetic in XLA
(`reference`: each operand scaled back in f32, then one f32 product). Mosaic GPU kernels run
on Hopper GPUs only: tests/kernels/test_fp8_gemm.py checks the reference against float64 on
CPU and the kernel against it on a Hopper GPU; benchmarks/fp8_decode.py times it beside
cuBLASLt's block-scaled GEMM (torch._scaled_mm). Knows nothing of models:
hybrid_jax/layers/fp8.fp8_matmul decides where it runs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.stream_gemm import smem_transforms

BLOCK = 128  # the scale block: activations' group width, the weight's block, the k tile
TM = 64  # rows per compute warpgroup
WGS = 2  # compute warpgroups per CTA
ROWS = TM * WGS  # rows per CTA
SMEM_BYTES = 227 * 1024
FP8 = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = float(jnp.finfo(FP8).max)  # 448


@dataclass(frozen=True)
class Fp8GemmConfig:
    # H100, 8192 rows (docs/benchmarks.md "FP8 products"): tn 128 with 4 buffers was the
    # fastest at 8192 x 8192 (1340 against tn 256's 1768 us) and at n = 4384, even at 11264.
    tn: int = 128  # output columns per CTA: 128 or 256
    stages: int = 4  # shared-memory buffers in the ring


def fits(rows: int, k: int, n: int, block: int) -> bool:
    """Whether `fp8_block_matmul` takes this product: 128 x 128 scale blocks and whole
    blocks in k (n may end inside a block: the last tile's rows past n read as zeros)."""
    return block == BLOCK and rows > 0 and k % BLOCK == 0 and n > 0


def tile_for(n: int, cfg: Fp8GemmConfig) -> Fp8GemmConfig:
    """cfg with tn cut to 128 where tn does not divide n: every tile then starts inside
    the weight and owns one row of its block scales."""
    if n % cfg.tn == 0:
        return cfg
    return Fp8GemmConfig(tn=BLOCK, stages=cfg.stages)


def smem_bytes(cfg: Fp8GemmConfig, out_itemsize: int = 2) -> int:
    """Shared memory a CTA allocates: the ring (x and weight tiles, x's scales), the output
    staging tile of each compute warpgroup and the barriers, each allocation rounded up to
    the 1 KiB Mosaic GPU aligns it to."""
    def kib(b):
        return -(-b // 1024) * 1024
    ring = kib(cfg.stages * ROWS * BLOCK) + kib(cfg.stages * cfg.tn * BLOCK) + kib(cfg.stages * ROWS * 4)
    return ring + kib(WGS * TM * BLOCK * out_itemsize) + 4 * 1024


def check(m: int, k: int, n: int, cfg: Fp8GemmConfig, out_itemsize: int = 2) -> None:
    """ValueError naming what does not fit (shapes, tile, shared memory)."""
    if cfg.tn not in (BLOCK, 2 * BLOCK):
        raise ValueError(f"tn={cfg.tn} must be 128 or 256")
    if m % ROWS:
        raise ValueError(f"m={m} rows must be a multiple of {ROWS} (fp8_block_matmul pads)")
    if k % BLOCK:
        raise ValueError(f"k={k} must be a multiple of {BLOCK}")
    if n % cfg.tn and cfg.tn != BLOCK:
        raise ValueError(f"n={n} must be a multiple of tn={cfg.tn} (tn=128 takes any n)")
    if cfg.stages < 2:
        raise ValueError(f"stages={cfg.stages} must be >= 2")
    need = smem_bytes(cfg, out_itemsize)
    if need > SMEM_BYTES:
        raise ValueError(f"{need} bytes of shared memory > {SMEM_BYTES}: lower stages or tn")


def quantize_rows(x: jax.Array, block: int = BLOCK) -> tuple[jax.Array, jax.Array]:
    """x [m, k] (k a multiple of block) -> (xq [m, k] e4m3, xs [m, k/block] f32): each row's
    128-wide groups scaled so their largest magnitude is 448 (an all-zero group: scale 1),
    the checkpoints' dynamic activation scheme; x = xq * xs up to e4m3 rounding."""
    m, k = x.shape
    g = x.astype(jnp.float32).reshape(m, k // block, block)
    amax = jnp.max(jnp.abs(g), axis=-1)
    xs = jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)
    xq = jnp.clip(g / xs[..., None], -FP8_MAX, FP8_MAX).astype(FP8)
    return xq.reshape(m, k), xs


def reference(xq: jax.Array, xs: jax.Array, wq: jax.Array, ws: jax.Array, out_dtype) -> jax.Array:
    """XLA, the kernel's arithmetic: xq times its group scales and wq times its block scales,
    each exact in f32, then one f32 product (the kernel sums the same block products in
    another order)."""
    m, k = xq.shape
    n = wq.shape[0]
    xf = (xq.astype(jnp.float32).reshape(m, k // BLOCK, BLOCK) * xs[..., None]).reshape(m, k)
    s = jnp.repeat(jnp.repeat(ws.astype(jnp.float32), BLOCK, axis=0), BLOCK, axis=1)[:n, :k]
    wf = wq.astype(jnp.float32) * s
    y = lax.dot_general(xf, wf, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                        preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


def fp8_block_matmul(x: jax.Array, wq: jax.Array, ws: jax.Array, *,
                     cfg: Fp8GemmConfig = Fp8GemmConfig(), out_dtype=None,
                     impl: str = "pallas") -> jax.Array:
    """x [m, k] (compute dtype) times the e4m3 W [n, k] with block scales ws
    [ceil(n/128), k/128], transposed: y [m, n] in out_dtype (x's). x is quantized per token
    and 128-wide group first (`quantize_rows`). `impl="reference"`: XLA (`reference`)."""
    m, k = x.shape
    n = wq.shape[0]
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if wq.dtype != FP8 or wq.shape[1] != k:
        raise ValueError(f"W must be e4m3 [n, {k}], got {wq.dtype}{wq.shape}")
    if ws.shape != (-(-n // BLOCK), -(-k // BLOCK)):
        raise ValueError(f"scales must be {(-(-n // BLOCK), -(-k // BLOCK))}, got {ws.shape}")
    if k % BLOCK:
        raise ValueError(f"k={k} must be a multiple of {BLOCK}")
    xq, xs = quantize_rows(x)
    if impl == "reference":
        return reference(xq, xs, wq, ws, out_dtype)
    cfg = tile_for(n, cfg)
    rows = -(-m // ROWS) * ROWS
    check(rows, k, n, cfg, out_dtype.itemsize)
    if rows != m:
        xq = jnp.pad(xq, ((0, rows - m), (0, 0)))
        xs = jnp.pad(xs, ((0, rows - m), (0, 0)), constant_values=1.0)
    y = _kernel(xq, xs.T, wq, ws.astype(jnp.float32), cfg.tn, cfg.stages, out_dtype)
    return y[:m, :n] if y.shape != (m, n) else y


@functools.partial(jax.jit, static_argnums=(4, 5, 6))
def _kernel(xq, xs_t, wq, ws, tn: int, stages: int, out_dtype):
    """xq [m, k] e4m3 (m a multiple of 128), xs_t [k/128, m] f32 (x's scales, transposed so
    a block's scales for a CTA's rows are one contiguous copy), wq [n, k] e4m3, ws
    [ceil(n/128), k/128] f32 -> y [m, ceil(n/tn) tn] in out_dtype: whole tiles (Mosaic GPU's
    tiled stores), the columns past n computed from the zeros TMA reads past wq's rows."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    m, k = xq.shape
    n = wq.shape[0]
    tiles = pl.cdiv(n, tn)
    steps = k // BLOCK
    sub = tn // BLOCK
    f8_tr = smem_transforms(BLOCK, 1)
    out_tr = smem_transforms(BLOCK, jnp.dtype(out_dtype).itemsize)

    def body(x_g, xs_g, w_g, ws_g, o_g, scoped):
        x_s, w_s, xs_s, o_s, x_bar, w_bar, s_bar, done = scoped
        i_m = lax.axis_index("m")
        i_n = lax.axis_index("n")
        wg = lax.axis_index("wg")
        m0 = i_m * ROWS
        n0 = i_n * tn

        @pl.when(wg == WGS)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def fetch(i, slot):
                kk = pl.ds(i * BLOCK, BLOCK)
                plgpu.copy_gmem_to_smem(x_g.at[pl.ds(m0, ROWS), kk], x_s.at[slot], x_bar.at[slot])
                plgpu.copy_gmem_to_smem(w_g.at[pl.ds(n0, tn), kk], w_s.at[slot], w_bar.at[slot])
                plgpu.copy_gmem_to_smem(xs_g.at[i, pl.ds(m0, ROWS)], xs_s.at[slot], s_bar.at[slot])

            for i in range(min(stages, steps)):
                fetch(i, i)
            if steps > stages:
                @pl.loop(0, steps - stages)
                def _refill(i):
                    slot = lax.rem(i, stages)
                    plgpu.barrier_wait(done.at[slot])  # both compute warpgroups are done with it
                    fetch(i + stages, slot)

        @pl.when(wg < WGS)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            r0 = pl.multiple_of(wg * TM, TM)
            cb0 = i_n * sub  # this CTA's first weight-scale row

            def scales(i):  # the weight scales of block i, one per 128 columns (global memory)
                return tuple(ws_g[cb0 + j, i] for j in range(sub))

            def step(i, carry):
                accs, s_cur = carry
                slot = lax.rem(i, stages)
                s_nxt = scales(jnp.minimum(i + 1, steps - 1))  # loaded a step ahead: latency hidden
                plgpu.barrier_wait(x_bar.at[slot])
                plgpu.barrier_wait(w_bar.at[slot])
                plgpu.barrier_wait(s_bar.at[slot])
                xsv = plgpu.load(xs_s.at[slot, pl.ds(r0, TM)], (), layout=plgpu.Layout.WGMMA.reduce(1))
                a = x_s.at[slot, pl.ds(r0, TM)]
                out = []
                for j in range(sub):
                    b = plgpu.transpose_ref(w_s.at[slot, pl.ds(j * BLOCK, BLOCK)], (1, 0))

                    def mma(acc_ref, b=b):
                        plgpu.wgmma(acc_ref, a, b)
                        return acc_ref[...]  # waits for the product

                    part = pl.run_scoped(mma, plgpu.ACC((TM, BLOCK), jnp.float32))
                    scale = lax.broadcast_in_dim(xsv * s_cur[j], (TM, BLOCK), [0])
                    out.append(accs[j] + part * scale)
                plgpu.barrier_arrive(done.at[slot])  # this warpgroup has read the slot
                return tuple(out), s_nxt

            zero = plgpu.layout_cast(jnp.zeros((TM, BLOCK), jnp.float32), plgpu.Layout.WGMMA)

            accs, _ = lax.fori_loop(0, steps, step, ((zero,) * sub, scales(0)))
            o_w = o_s.at[wg]
            for j in range(sub):
                if j:
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # o_w's previous copy has read it
                o_w[...] = accs[j].astype(out_dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_w, o_g.at[pl.ds(m0 + r0, TM), pl.ds(n0 + j * BLOCK, BLOCK)])
            plgpu.wait_smem_to_gmem(0)

    def entry(x_g, xs_g, w_g, ws_g, o_g):
        pl.run_scoped(
            lambda *scoped: body(x_g, xs_g, w_g, ws_g, o_g, scoped),
            plgpu.SMEM((stages, ROWS, BLOCK), FP8, transforms=f8_tr),
            plgpu.SMEM((stages, tn, BLOCK), FP8, transforms=f8_tr),
            plgpu.SMEM((stages, ROWS), jnp.float32),
            plgpu.SMEM((WGS, TM, BLOCK), out_dtype, transforms=out_tr),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_arrivals=WGS, num_barriers=stages),
            collective_axes="wg",
        )

    # Mosaic GPU names the kernel after its body: profiler traces then show what runs.
    entry.__name__ = "fp8_block_gemm"
    return plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((m, tiles * tn), out_dtype),
        grid=(m // ROWS, tiles),
        grid_names=("m", "n"),
        num_threads=WGS + 1,
        thread_name="wg",
    )(xq, xs_t, wq, ws)
