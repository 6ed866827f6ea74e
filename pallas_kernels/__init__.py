"""GPU kernels for hybrid-jax, each beside a pure-JAX reference with the same signature.

`backend.resolve_impl` is the single switch between `pallas`, `interpret` and
`reference`. This package knows nothing of models, configs or scheduling: ops
take plain arrays (paged K/V, per-slot states, ragged offsets) and return arrays.
"""

from pallas_kernels.backend import IMPLS, Impl, default_impl, resolve_impl

__all__ = ["IMPLS", "Impl", "default_impl", "resolve_impl"]
