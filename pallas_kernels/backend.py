"""The one switch that picks how every kernel in `pallas_kernels` runs.

`pallas`    compiled Pallas kernels (GPU, lowered through Triton on jax 0.11).
`interpret` the same Pallas kernels run by the Pallas interpreter (CPU tests).
`reference` the pure-JAX references beside each kernel (same signatures).

The choice is made once per process: the `HYBRID_JAX_KERNELS` environment
variable if set, otherwise `pallas` on a GPU backend and `reference` elsewhere.
Tests and benchmarks pass `impl=` explicitly to every op. There is no
try/except fallback anywhere: a kernel that fails to lower is a bug to fix.

This module knows nothing of models or scheduling.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax

from configs import switches

Impl = Literal["pallas", "interpret", "reference"]
IMPLS: tuple[Impl, ...] = ("pallas", "interpret", "reference")


@functools.cache
def default_impl() -> Impl:
    """The process-wide implementation, chosen once (env var, else by backend)."""
    env = switches.kernels()
    if env is not None:
        if env not in IMPLS:
            raise ValueError(f"HYBRID_JAX_KERNELS={env!r} must be one of {IMPLS}")
        return env  # type: ignore[return-value]
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def resolve_impl(impl: Impl | None) -> Impl:
    """`impl` if given (validated), else the process-wide default."""
    if impl is None:
        return default_impl()
    if impl not in IMPLS:
        raise ValueError(f"{impl=} must be one of {IMPLS}")
    return impl
