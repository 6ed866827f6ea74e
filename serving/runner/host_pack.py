"""A step's host inputs as ONE int32 buffer: one host-to-device transfer per step.

A step's small host arrays (the ragged batch, the feed rows, the sampling parameters,
checkpoint copies: ~25 arrays) cost a transfer each, ~30-80 us of host time apiece
(measured: 20 arrays of 64 ints, 1.2-1.6 ms; one array of the same bytes 0.12 ms).
`HostLayout` lays a pytree of numpy arrays end to end in one int32 vector (4-byte
dtypes bit-cast, bools as 0/1) and unpacks it inside the jitted step with static
slices, which XLA fuses into their consumers (single-device steps first copy the vector
once, `stage=True`, so that those consumers read an address that does not change).

The layout is static per shape: `host_layout(tree)` from the arrays (or
ShapeDtypeStructs) of a bucket; `pack` on the host, `unpack` on the device. A layout
may be padded to a larger `size` so that executables with different layouts of the
same leading fields take buffers of one shape (the sampler reads the sampling
fields, which come first, from every bucket's buffer of a sequence count).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.stage_copy import stage_copy

_FOUR_BYTE = (np.dtype(np.int32), np.dtype(np.uint32), np.dtype(np.float32))


@dataclass(frozen=True)
class HostLayout:
    treedef: object
    fields: tuple[tuple[int, tuple[int, ...], np.dtype], ...]  # (offset, shape, dtype)
    size: int  # int32 elements (>= the fields' end)

    def padded(self, size: int) -> HostLayout:
        if size < self.size:
            raise ValueError(f"a layout of {self.size} elements does not fit {size}")
        return HostLayout(self.treedef, self.fields, size)

    def pack(self, tree) -> np.ndarray:
        """Host: the tree's arrays (same shapes and dtypes as the layout) in one int32 vector."""
        leaves, treedef = jax.tree.flatten(tree)
        if treedef != self.treedef:
            raise ValueError(f"tree structure {treedef} is not the layout's {self.treedef}")
        buf = np.zeros(self.size, np.int32)
        for x, (off, shape, dtype) in zip(leaves, self.fields, strict=True):
            x = np.asarray(x)
            if x.shape != shape or x.dtype != dtype:
                raise ValueError(f"array {x.shape} {x.dtype} where the layout has {shape} {dtype}")
            n = x.size
            flat = x.reshape(-1)
            buf[off:off + n] = flat.astype(np.int32) if dtype == np.bool_ else flat.view(np.int32)
        return buf

    def unpack(self, buf: jax.Array, *, stage: bool = False):
        """Device (inside jit): the tree back from the vector.

        `stage`: first copy the vector with `stage_copy` (one kernel), so that the step's
        kernels read the copy, at an address that is the same every call, instead of this
        call's transfer: on a GPU, XLA updates each CUDA-graph node whose buffers moved,
        and ~80 nodes per decode step read these fields (`pallas_kernels/stage_copy.py`).
        Single-device steps only (the copy is not partitioned).
        """
        if stage:
            buf = stage_copy(buf)
        leaves = []
        for off, shape, dtype in self.fields:
            x = jax.lax.slice_in_dim(buf, off, off + int(np.prod(shape, dtype=np.int64)))
            if dtype == np.bool_:
                x = x != 0
            elif dtype != np.int32:
                x = jax.lax.bitcast_convert_type(x, jnp.dtype(dtype))
            leaves.append(x.reshape(shape))
        return jax.tree.unflatten(self.treedef, leaves)


def host_layout(tree) -> HostLayout:
    """The layout of a pytree of arrays or ShapeDtypeStructs (int32, uint32, float32, bool)."""
    leaves, treedef = jax.tree.flatten(tree)
    fields, off = [], 0
    for x in leaves:
        shape, dtype = tuple(x.shape), np.dtype(x.dtype)
        if dtype not in _FOUR_BYTE and dtype != np.bool_:
            raise TypeError(f"host inputs must be int32, uint32, float32 or bool, not {dtype}")
        fields.append((off, shape, dtype))
        off += int(np.prod(shape, dtype=np.int64))
    return HostLayout(treedef, tuple(fields), off)


def _private_transfer():
    """JAX's C++-backed transfer behind jax.device_put (private: may change or vanish)."""
    from jax._src.interpreters import pxla
    return pxla.batched_device_put


def host_put(sharding) -> Callable[[np.ndarray], jax.Array]:
    """A function putting one host array on the device(s) of `sharding` (replicated).

    `jax.device_put` spends ~80 us of Python per call on checks a step's packed buffer
    never needs (dev machine; 2-3x that on the GPU hosts), against ~9 us for the
    C++ transfer it ends in. The returned function calls that transfer
    (`pxla.batched_device_put`, a private JAX function) directly, if it exists here and
    a probe round-trips through it with the expected sharding; otherwise it is
    `jax.device_put`. Either way the result is a committed array with `sharding`.
    """
    plain = lambda x: jax.device_put(x, sharding)
    try:
        from jax._src import core
        transfer = _private_transfer()
        devices = list(sharding._addressable_device_assignment)

        def fast(x: np.ndarray) -> jax.Array:
            return transfer(core.ShapedArray(x.shape, x.dtype), sharding, [x] * len(devices), devices)

        probe = np.arange(7, dtype=np.int32)
        got = fast(probe)
        if got.sharding != sharding or not np.array_equal(np.asarray(got), probe) or not got.committed:
            return plain
    except Exception:  # noqa: BLE001 (any failure of the private path: the public one)
        return plain
    return fast
