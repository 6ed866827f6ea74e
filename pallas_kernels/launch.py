"""One place that turns a kernel body into a `pallas_call` for the chosen impl.

`pallas` compiles through the Triton lowering with the given warps and stages;
`interpret` runs the same body in the Pallas interpreter (CPU tests). Refs are
passed whole (no BlockSpecs): kernels index them with `pl.ds` and vectors of
row indices, so every block loaded or stored must have a power-of-2 size, but
the arrays themselves may have any shape.

Also the small helpers that every SSM kernel shares (dot precision policy,
power-of-2 channel blocks). This module knows nothing of what the kernels compute.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.backend import Impl


def launch(
    kernel: Callable[..., None],
    *,
    impl: Impl,
    grid: tuple[int, ...],
    out_shape: Sequence[jax.ShapeDtypeStruct],
    aliases: dict[int, int] | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    name: str | None = None,
) -> Callable[..., tuple[jax.Array, ...]]:
    """`pallas_call` over whole-array refs; `impl` is "pallas" or "interpret"."""
    return pl.pallas_call(
        kernel,
        grid=grid,
        out_shape=tuple(out_shape),
        input_output_aliases=aliases or {},
        name=name,
        **impl_kwargs(impl, num_warps, num_stages),
    )


def impl_kwargs(impl: Impl, num_warps: int, num_stages: int | None) -> dict:
    """`pallas_call`'s keywords for `impl` ("pallas": Triton warps and stages; "interpret")."""
    assert impl in ("pallas", "interpret"), impl
    if impl == "interpret":
        return {"interpret": True}
    return {"compiler_params": plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)}


def dot(a: jax.Array, b: jax.Array, *, trans_a: bool = False, trans_b: bool = False) -> jax.Array:
    """2-D matmul with f32 accumulation and a deliberate precision.

    bf16/f16 operands use the tensor cores natively; f32 operands use full f32
    (HIGHEST), never Triton's default TF32.
    """
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    dims = (((0,) if trans_a else (1,), (1,) if trans_b else (0,)), ((), ()))
    return jax.lax.dot_general(
        a, b, dims, precision=precision, preferred_element_type=jnp.float32
    )


def channel_block(c: int, cap: int = 256) -> int:
    """Largest power of two <= `cap` that divides `c` (blocks never overlap)."""
    block = 1
    while block * 2 <= cap and c % (block * 2) == 0:
        block *= 2
    return block


def is_pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0
