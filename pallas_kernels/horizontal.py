"""Independent kernels in one launch: their programs side by side in one grid.

A decode step at small batches runs kernels of a few microseconds whose programs fill a
fraction of the GPU: paged decode (b x KV heads x splits programs) and the Mamba2 state
update (b x heads x row blocks) of one layer read the same projection row and nothing of
each other. Launched apart, the second waits for the first's last program; launched as
one grid, the SMs the first leaves idle run the second's programs at once.

A `Part` is one kernel as `launch_parts` takes it: its body, written against
`pl.program_id` values passed in (`pids`), its own grid, operands and block specs in
terms of those ids. One part launches exactly as a `pallas_call` over its own grid would
(the same grid, specs and program order); several launch as one 1-D grid in which the
programs of part i follow those of part i - 1, each dispatching to its part's body under
`pl.when` (Triton allocates registers for the larger body: both share `num_warps`).

This module knows nothing of what the kernels compute.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.backend import Impl
from pallas_kernels.launch import impl_kwargs

IndexFn = Callable[..., tuple]  # the part's program ids -> block indices


@dataclass(frozen=True)
class Block:
    """A block of an operand or output: its shape (None: a squeezed dim) and index."""

    shape: tuple[int | None, ...]
    index: IndexFn


@dataclass(frozen=True)
class Part:
    """One kernel: body(*in_refs, *out_refs, pids=(i0, i1, ...)) over `grid`; `blocks` and
    `out_blocks` per operand and output (None: the whole array); `aliases` {operand
    index: output index}, within the part."""

    body: Callable[..., None]
    grid: tuple[int, ...]
    operands: tuple[jax.Array, ...]
    blocks: tuple[Block | None, ...]
    out_shape: tuple[jax.ShapeDtypeStruct, ...]
    out_blocks: tuple[Block | None, ...]
    aliases: dict[int, int]

    @property
    def programs(self) -> int:
        return math.prod(self.grid)


class Deferred(NamedTuple):
    """A kernel call not yet launched: its static arguments (a hashable NamedTuple that
    its module turns into a `Part`), operands, warps, and `finish`, which maps the launch's
    outputs to what the call would have returned."""

    static: Any
    operands: tuple[jax.Array, ...]
    num_warps: int
    finish: Callable[[tuple[jax.Array, ...]], Any]


def _whole(shape) -> pl.BlockSpec:
    return pl.BlockSpec(tuple(shape), lambda *_: (0,) * len(shape))


def _unravel(i, grid: tuple[int, ...]) -> tuple:
    """Program i of a grid whose first dim varies fastest (as a CUDA grid's x)."""
    ids = []
    for n in grid:
        ids.append(i % n)
        i = i // n
    return tuple(ids)


def _clamped_ids(start: int, part: Part) -> Callable:
    return lambda i: _unravel(jnp.clip(i - start, 0, part.programs - 1), part.grid)


def _spec(block: Block | None, shape, ids: Callable) -> pl.BlockSpec:
    if block is None:
        return _whole(shape)
    return pl.BlockSpec(block.shape, lambda *g: block.index(*ids(*g)))


def launch_parts(parts: Sequence[Part], *, impl: Impl, num_warps: int, num_stages: int | None,
                 name: str) -> tuple[jax.Array, ...]:
    """Run the parts in one `pallas_call`; returns every part's outputs, in order."""
    if len(parts) == 1:
        (part,) = parts
        grid, id_maps, starts = part.grid, [lambda *g: g], [0]
    else:
        starts = [0]
        for p in parts:
            starts.append(starts[-1] + p.programs)
        grid = (starts[-1],)
        # A program of another part reads and writes no block of this one: its block
        # indices are clamped to this part's range, and its body does not run.
        id_maps = [_clamped_ids(s, p) for s, p in zip(starts, parts, strict=False)]
    in_specs, out_specs, operands, out_shape, aliases = [], [], [], [], {}
    for p, ids in zip(parts, id_maps, strict=True):
        for i, o in p.aliases.items():
            aliases[len(operands) + i] = len(out_shape) + o
        in_specs += [_spec(b, x.shape, ids) for b, x in zip(p.blocks, p.operands, strict=True)]
        out_specs += [_spec(b, s.shape, ids) for b, s in zip(p.out_blocks, p.out_shape, strict=True)]
        operands += p.operands
        out_shape += p.out_shape
    counts = [(len(p.operands), len(p.out_shape)) for p in parts]

    def kernel(*refs):
        n_in = sum(c[0] for c in counts)
        ins, outs = refs[:n_in], refs[n_in:]
        if len(parts) == 1:
            parts[0].body(*ins, *outs, pids=tuple(pl.program_id(a) for a in range(len(grid))))
            return
        pid = pl.program_id(0)
        a = b = 0
        for p, s, (ni, no) in zip(parts, starts, counts, strict=False):
            own = (ins[a:a + ni], outs[b:b + no])

            @pl.when((pid >= s) & (pid < s + p.programs))
            def _(p=p, s=s, own=own):
                p.body(*own[0], *own[1], pids=_unravel(pid - s, p.grid))

            a, b = a + ni, b + no

    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=tuple(out_shape),
        input_output_aliases=aliases, name=name, **impl_kwargs(impl, num_warps, num_stages),
    )(*operands)
