"""Int32 index arrays offset by several constants each, all in one launch.

    offset_indices((x_1, ..., x_m), (offs_1, ..., offs_m))
        -> ((x_1 + o for o in offs_1), ..., (x_m + o for o in offs_m))

The engine's caches are stacked by kind (hybrid_jax/cache.py): layer l reads its pages
and slots at an offset in one pool, so each layer's kernels take the step's page table,
slot mapping and slot ids shifted by its own constant. As separate XLA adds these were
~45 extra kernels of ~1 us in a 24-layer decode step (+0.056 ms at batch 1 on the H100:
XLA fused only some of them); here every layer's copy of every index array is written by
one launch. Program (i, j) takes block i of array j and writes it, shifted, to each of
that array's outputs.

This module knows nothing of models or scheduling.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.backend import Impl, resolve_impl
from pallas_kernels.launch import launch

BLOCK = 1024  # elements per program


def offset_indices_reference(xs: tuple[jax.Array, ...], offsets: tuple[tuple[int, ...], ...]
                             ) -> tuple[tuple[jax.Array, ...], ...]:
    return tuple(tuple(x + jnp.asarray(o, x.dtype) for o in offs)
                 for x, offs in zip(xs, offsets, strict=True))


def _kernel(*refs, sizes: tuple[int, ...], block: int, offsets: tuple[tuple[int, ...], ...]):
    x_refs, outs = refs[:len(sizes)], list(refs[len(sizes):])
    start = pl.program_id(0) * block
    for j, (x_ref, n, offs) in enumerate(zip(x_refs, sizes, offsets, strict=True)):
        mine = [outs.pop(0) for _ in offs]

        @pl.when(pl.program_id(1) == j)
        def _(x_ref=x_ref, n=n, offs=offs, mine=mine):
            ok = start + jnp.arange(block) < n
            v = plgpu.load(x_ref.at[pl.ds(start, block)], mask=ok, other=0)
            for o, ref in zip(offs, mine, strict=True):
                plgpu.store(ref.at[pl.ds(start, block)], v + o, mask=ok)


@functools.partial(jax.jit, static_argnames=("offsets", "impl"))
def _offset(flats, *, offsets, impl):
    sizes = tuple(x.shape[0] for x in flats)
    block = min(BLOCK, 1 << max(0, (max(sizes) - 1).bit_length()))
    shapes = [jax.ShapeDtypeStruct((n,), jnp.int32) for n, offs in zip(sizes, offsets, strict=True)
              for _ in offs]
    kernel = functools.partial(_kernel, sizes=sizes, block=block, offsets=offsets)
    return launch(kernel, impl=impl, grid=(-(-max(sizes) // block), len(flats)), out_shape=shapes,
                  num_warps=4 if block >= 512 else 1, name="offset_indices")(*flats)


def offset_indices(xs: tuple[jax.Array, ...], offsets: tuple[tuple[int, ...], ...], *,
                   impl: Impl | None = None) -> tuple[tuple[jax.Array, ...], ...]:
    """xs: int32 arrays (any shapes); offsets[j]: static constants for xs[j]. Returns, per
    array, x + o for each of its constants (x's shape)."""
    if len(xs) != len(offsets):
        raise ValueError(f"{len(xs)} arrays but {len(offsets)} offset lists")
    if any(x.dtype != jnp.int32 for x in xs):
        raise ValueError(f"xs must be int32, not {[str(x.dtype) for x in xs]}")
    offsets = tuple(tuple(int(o) for o in offs) for offs in offsets)
    if any(not -2**31 <= o < 2**31 for offs in offsets for o in offs):
        raise ValueError(f"{offsets=} outside int32")
    impl = resolve_impl(impl)
    live = [j for j, (x, offs) in enumerate(zip(xs, offsets, strict=True)) if offs and x.size]
    if impl == "reference" or not live:
        return offset_indices_reference(xs, offsets)
    flat = iter(_offset(tuple(xs[j].reshape(-1) for j in live),
                        offsets=tuple(offsets[j] for j in live), impl=impl))
    return tuple(tuple(next(flat).reshape(x.shape) for _ in offs) if j in live
                 else offset_indices_reference((x,), (offs,))[0]  # no offsets, or an empty x
                 for j, (x, offs) in enumerate(zip(xs, offsets, strict=True)))
