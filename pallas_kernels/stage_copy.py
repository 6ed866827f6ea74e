"""Copies XLA keeps, at a step's two ends, so that its CUDA graph's nodes keep their addresses.

    stage_copy(x) = x                      a per-call input, copied once into the step's memory
    write_into(dsts, srcs) = srcs          results written into donated buffers, in place

Why a kernel for a copy: XLA removes plain copies and fuses static slices of a
parameter into their consumers, so every kernel that reads a field of the step's
packed host input (page tables, slot ids, lengths: ~80 kernels per decode step of a
24-layer hybrid) reads the parameter's own buffer. That buffer is a fresh host-to-device
transfer each call, at a new address, and XLA's CUDA-graph runtime updates every graph
node that reads a buffer whose address changed: ~80 node updates per call, 0.25-0.45 ms
of host time on an H100 host, measured (docs/history/benchmarks-2026.md, seventh pass). A custom
call is neither removed nor fused, so with this copy first the consumers read the
copy, which lives in the step's temporary buffer at an address that does not change
between calls, and only this kernel's node is updated.

`write_into` is the same problem at the other end. A step's results go into donated
buffers (serving/runner/runner.py cycles a few sets: the host still reads one step's results
while the next step runs), but XLA places temporaries inside a donated buffer whose old
value is never read, before the result is written there; every node using those
temporaries is then updated when the set changes (78 nodes of a decode step, measured).
This kernel reads the donated buffers (aliased to its outputs), so their values are live
from the step's start until the kernel, and nothing else can be placed in them.

Grid: one program per `BLOCK` elements (of the longest array for `write_into`), masked
at each array's end. The references are the identity (there is no
graph to update off the GPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.backend import Impl, resolve_impl
from pallas_kernels.launch import launch

BLOCK = 4096


def stage_copy_reference(x: jax.Array) -> jax.Array:
    return x


def _copy_kernel(x_ref, o_ref, *, n: int):
    i = pl.program_id(0)
    idx = i * BLOCK + jax.lax.broadcasted_iota(jnp.int32, (BLOCK,), 0)
    ok = idx < n
    block = pl.ds(i * BLOCK, BLOCK)
    plgpu.store(o_ref.at[block], plgpu.load(x_ref.at[block], mask=ok, other=0), mask=ok)


@functools.partial(jax.jit, static_argnames=("impl",))
def _stage_copy(x: jax.Array, impl: Impl) -> jax.Array:
    n = x.shape[0]
    (y,) = launch(functools.partial(_copy_kernel, n=n), impl=impl, grid=(pl.cdiv(n, BLOCK),),
                  out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype)], name="stage_copy")(x)
    return y


def stage_copy(x: jax.Array, *, impl: Impl | None = None) -> jax.Array:
    """x copied by one kernel that XLA neither removes nor fuses (see the module doc)."""
    if x.ndim != 1 or jnp.dtype(x.dtype).itemsize != 4:
        raise ValueError(f"stage_copy takes a 1-D array of a 4-byte dtype, not {x.shape} {x.dtype}")
    impl = resolve_impl(impl)
    if impl == "reference" or x.shape[0] == 0:
        return stage_copy_reference(x)
    return _stage_copy(x, impl)


def _write_kernel(*refs, sizes: tuple[int, ...]):
    n = len(sizes)
    srcs, outs = refs[:n], refs[2 * n:]
    i = pl.program_id(0)
    idx = i * BLOCK + jax.lax.broadcasted_iota(jnp.int32, (BLOCK,), 0)
    block = pl.ds(i * BLOCK, BLOCK)
    for src, out, size in zip(srcs, outs, sizes, strict=True):
        ok = idx < size
        plgpu.store(out.at[block], plgpu.load(src.at[block], mask=ok, other=0), mask=ok)


@functools.partial(jax.jit, static_argnames=("impl",))
def _write_into(dsts: tuple[jax.Array, ...], srcs: tuple[jax.Array, ...], impl: Impl):
    n = len(srcs)
    flat = [x.reshape(-1) for x in (*srcs, *dsts)]
    sizes = tuple(int(x.size) for x in srcs)
    outs = launch(functools.partial(_write_kernel, sizes=sizes), impl=impl,
                  grid=(pl.cdiv(max(sizes), BLOCK),),
                  out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in flat[n:]],
                  aliases={n + i: i for i in range(n)}, name="write_into")(*flat)
    return tuple(o.reshape(d.shape) for o, d in zip(outs, dsts, strict=True))


def write_into(dsts, srcs, *, impl: Impl | None = None):
    """`srcs` (a tuple of arrays) written into `dsts` (same shapes and 4-byte dtypes; donated
    by the caller), in place: returns arrays equal to `srcs` in `dsts`' buffers."""
    dsts, srcs = tuple(dsts), tuple(srcs)
    if len(dsts) != len(srcs) or any(d.shape != s.shape or d.dtype != s.dtype
                                     for d, s in zip(dsts, srcs, strict=True)):
        raise ValueError("write_into: destinations and sources must match in shape and dtype")
    if any(jnp.dtype(s.dtype).itemsize != 4 for s in srcs):
        raise ValueError("write_into takes 4-byte dtypes only")
    impl = resolve_impl(impl)
    if impl == "reference" or not srcs:
        return srcs
    return _write_into(dsts, srcs, impl)
