"""Few large arrays into the step instead of hundreds: packed parameters.

Every array passed to a compiled executable costs the host several microseconds per
call (measured on the H100 with jax 0.11.2: ~10 us per argument, so the 529 arrays of a
1.4B hybrid's step took ~5 ms to hand over while its kernels needed 5.4 ms). The runner
therefore passes the model's parameters as one flat buffer per dtype and slices them
back into shape inside the step; XLA fuses the static slices into their consumers
(no copies), so the packing costs no device time.

A buffer holds at most MAX_BUFFER_ELEMENTS elements (a leaf larger than that gets a
buffer of its own): XLA's generated GPU kernels index with 32 bits, and a fusion that
slices a buffer of more than 2**31 elements reads out of bounds (seen on the H100 as
CUDA_ERROR_ILLEGAL_INSTRUCTION while compiling a 3B model); the autotuner also copies
each input buffer it times, so multi-GB buffers exhausted memory for 8-9B models.

This module knows nothing of models or scheduling: it packs a pytree of arrays.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ALIGN = 128  # elements: every leaf starts on a 256-byte (bf16) / 512-byte (f32) boundary
MAX_BUFFER_ELEMENTS = 1 << 28  # 512 MiB of bf16 per buffer


@dataclass(frozen=True)
class PackLayout:
    """Where each leaf of a pytree lives in the packed buffers (static: hashable, no arrays)."""

    treedef: Any
    dtypes: tuple[str, ...]  # the dtype of each buffer (a dtype may fill several)
    leaves: tuple[tuple[int, int, tuple[int, ...]], ...]  # (buffer, offset, shape) per leaf
    sizes: tuple[int, ...]  # elements per buffer


def plan_layout(tree: Any, max_elements: int = MAX_BUFFER_ELEMENTS,
                own: Callable[[Any], bool] | None = None) -> PackLayout:
    """own(leaf): whether a leaf gets a buffer of its own, exactly its size, whatever its
    size: a leaf that a custom call reads whole (a Pallas kernel's operand), which XLA
    would copy out of a shared buffer before every call."""
    leaves, treedef = jax.tree.flatten(tree)
    dtypes: list[str] = []
    fill: list[int] = []
    open_buf: dict[str, int] = {}  # dtype -> the buffer being filled
    where = []
    for x in leaves:
        name = jnp.dtype(x.dtype).name
        size = int(np.prod(x.shape, dtype=np.int64))
        if own is not None and own(x):
            dtypes.append(name)
            fill.append(size)
            where.append((len(dtypes) - 1, 0, tuple(int(d) for d in x.shape)))
            continue
        room = -(-max(size, 1) // ALIGN) * ALIGN
        b = open_buf.get(name)
        if b is None or (fill[b] and fill[b] + room > max_elements):
            dtypes.append(name)
            fill.append(0)
            b = open_buf[name] = len(dtypes) - 1
        where.append((b, fill[b], tuple(int(d) for d in x.shape)))
        fill[b] += room
    return PackLayout(treedef, tuple(dtypes), tuple(where), tuple(fill))


def pack(tree: Any, layout: PackLayout | None = None,
         own: Callable[[Any], bool] | None = None) -> tuple[PackLayout, tuple[jax.Array, ...]]:
    """(layout, buffers): each leaf copied once into its dtype's flat buffer (`plan_layout`).
    A buffer that is exactly one leaf (a leaf with a buffer of its own) is that leaf's array
    itself, in its own shape: not copied, so a model's largest arrays (a MoE layer's expert
    stacks: 32 GB of a 35B-A3B's 36) are never held twice while the engine starts."""
    layout = layout or plan_layout(tree, own=own)
    leaves = jax.tree.leaves(tree)
    bufs = []
    for b, name in enumerate(layout.dtypes):
        mine = [x for x, (bi, _, _) in zip(leaves, layout.leaves, strict=True) if bi == b]
        if len(mine) == 1 and mine[0].size == layout.sizes[b] and jnp.dtype(mine[0].dtype).name == name:
            bufs.append(mine[0])
            continue
        parts, at = [], 0
        for x, (bi, off, shape) in zip(leaves, layout.leaves, strict=True):
            if bi != b:
                continue
            if off > at:
                parts.append(jnp.zeros((off - at,), name))
            parts.append(jnp.ravel(x).astype(name))
            at = off + int(np.prod(shape, dtype=np.int64))
        if layout.sizes[b] > at:
            parts.append(jnp.zeros((layout.sizes[b] - at,), name))
        bufs.append(jnp.concatenate(parts) if len(parts) > 1 else parts[0])
    return layout, tuple(bufs)


def unpack(layout: PackLayout, bufs: tuple[jax.Array, ...]) -> Any:
    """The pytree back from its buffers (inside jit: static slices, fused by XLA; a buffer
    that is one leaf in its own shape, `pack`'s, is that leaf)."""
    leaves = []
    for b, off, shape in layout.leaves:
        if bufs[b].ndim > 1:  # the leaf itself (pack); flat buffers are 1-D
            if tuple(bufs[b].shape) != tuple(shape):
                raise ValueError(f"buffer {b} {bufs[b].shape} is not its leaf's shape {shape}")
            leaves.append(bufs[b])
            continue
        size = int(np.prod(shape, dtype=np.int64))
        leaves.append(jax.lax.slice(bufs[b], (off,), (off + size,)).reshape(shape))
    return jax.tree.unflatten(layout.treedef, leaves)


def pack_host(layout: PackLayout, leaves: list[np.ndarray]) -> list[np.ndarray]:
    """`pack` on the host (numpy): one device's buffers, built without touching a device."""
    bufs = [np.zeros((size,), np.dtype(jnp.dtype(name))) for name, size in zip(layout.dtypes, layout.sizes,
                                                                               strict=True)]
    for x, (b, off, shape) in zip(leaves, layout.leaves, strict=True):
        assert tuple(x.shape) == shape, (x.shape, shape)
        bufs[b][off:off + x.size] = np.ravel(x).astype(bufs[b].dtype)
    return bufs
