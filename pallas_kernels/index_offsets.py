"""One int32 index array offset by several constants, in one launch.

    offset_indices(x, (o_1, ..., o_n)) -> (x + o_1, ..., x + o_n)

The engine's caches are stacked by kind (hybrid_jax/cache.py): layer l reads its pages
and slots at an offset in one pool, so each layer's kernels take the step's page table,
slot mapping and slot ids shifted by its own constant. As separate XLA adds these were
~45 extra kernels of ~1 us in a 24-layer decode step (+0.056 ms at batch 1 on the H100:
XLA fused only some of them); here every layer's copy of one array is written by one
launch. Programs each take a block of x's elements and write it, shifted, to every output.

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


def offset_indices_reference(x: jax.Array, offsets: tuple[int, ...]) -> tuple[jax.Array, ...]:
    return tuple(x + jnp.asarray(o, x.dtype) for o in offsets)


def _kernel(x_ref, *out_refs, n: int, block: int, offsets: tuple[int, ...]):
    start = pl.program_id(0) * block
    ok = start + jnp.arange(block) < n
    v = plgpu.load(x_ref.at[pl.ds(start, block)], mask=ok, other=0)
    for o, ref in zip(offsets, out_refs, strict=True):
        plgpu.store(ref.at[pl.ds(start, block)], v + o, mask=ok)


@functools.partial(jax.jit, static_argnames=("offsets", "impl"))
def _offset(flat, *, offsets, impl):
    n = flat.shape[0]
    block = min(BLOCK, 1 << max(0, (n - 1).bit_length()))
    shape = jax.ShapeDtypeStruct((n,), flat.dtype)
    kernel = functools.partial(_kernel, n=n, block=block, offsets=offsets)
    return launch(kernel, impl=impl, grid=(-(-n // block),), out_shape=[shape] * len(offsets),
                  num_warps=4 if block >= 512 else 1, name="offset_indices")(flat)


def offset_indices(x: jax.Array, offsets: tuple[int, ...], *, impl: Impl | None = None
                   ) -> tuple[jax.Array, ...]:
    """x int32 (any shape) -> x + o for each static o of `offsets`, each x's shape."""
    if x.dtype != jnp.int32:
        raise ValueError(f"x must be int32, not {x.dtype}")
    offsets = tuple(int(o) for o in offsets)
    if any(not -2**31 <= o < 2**31 for o in offsets):
        raise ValueError(f"{offsets=} outside int32")
    impl = resolve_impl(impl)
    if not offsets:
        return ()
    if impl == "reference" or x.size == 0:
        return offset_indices_reference(x, offsets)
    outs = _offset(x.reshape(-1), offsets=offsets, impl=impl)
    return tuple(o.reshape(x.shape) for o in outs)
