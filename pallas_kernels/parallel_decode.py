"""A parallel hybrid layer's two decode kernels in one launch.

    attention_ssm_decode(attention call, Mamba2 call)
        == (paged_attention_decode_fused(..., merge=False), ssm_decode_packed(...))

Attention and Mamba2 side by side in one layer (Falcon-H1, the native hybrids) read one
projection row and nothing of each other: paged decode (RoPE and the K/V write included)
and the Mamba2 state update run as one grid (`horizontal.launch_parts`), the state
update's programs after paged decode's. At small batches neither fills the GPU, and
launched apart the state update waited for paged decode's last program.

Each call is checked and planned by its own op (`defer=True`); where either would not
launch its kernel (the reference impl, shapes it does not take, different warps) both
run as they would apart, so the result never depends on which path ran.

This module knows nothing of models or scheduling.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from pallas_kernels.backend import resolve_impl
from pallas_kernels.horizontal import Deferred, launch_parts
from pallas_kernels.paged_attention import paged_attention_decode_fused
from pallas_kernels.paged_decode import decode_fused_part
from pallas_kernels.ssm_decode import decode_packed_part, ssm_decode_packed


def attention_ssm_decode(attention: dict[str, Any], ssm: dict[str, Any]) -> tuple[tuple, tuple]:
    """attention: `paged_attention_decode_fused`'s keyword arguments (merge False is
    implied), ssm: `ssm_decode_packed`'s, both with the same `impl` if any. Returns
    ((DecodeParts, k_pages, v_pages), (y, states[, conv_states])), what the two calls
    return."""
    if attention.get("impl") != ssm.get("impl"):
        raise ValueError(f"impl {attention.get('impl')!r} != {ssm.get('impl')!r}: one launch, one impl")
    a = paged_attention_decode_fused(**attention, merge=False, defer=True)
    s = ssm_decode_packed(**ssm, defer=True)
    if not (isinstance(a, Deferred) and isinstance(s, Deferred)) or a.num_warps != s.num_warps:
        # Apart (a deferred call emitted nothing the step keeps: XLA drops it).
        return paged_attention_decode_fused(**attention, merge=False), ssm_decode_packed(**ssm)
    out = _launch_both(a.operands, s.operands, attention=a.static, ssm=s.static, num_warps=a.num_warps,
                       interpret=resolve_impl(attention.get("impl")) == "interpret")
    n = len(out) - s.static.outputs  # the state update's outputs come last
    return a.finish(out[:n]), s.finish(out[n:])


@functools.partial(jax.jit, static_argnames=("attention", "ssm", "num_warps", "interpret"))
def _launch_both(attention_operands, ssm_operands, *, attention, ssm, num_warps, interpret):
    """One launch; a function of the static arguments only, so every layer's call is one
    function, lowered once per executable (cold start-up)."""
    parts = (decode_fused_part(*attention_operands, **attention._asdict()),
             decode_packed_part(*ssm_operands, **ssm._asdict()))
    return launch_parts(parts, impl="interpret" if interpret else "pallas", num_warps=num_warps,
                        num_stages=1, name="attention_ssm_decode")
