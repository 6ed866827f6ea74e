"""The byte floor of a decode step and the copy bandwidth it is measured against.

A decode step must at least read every weight once (the input embedding only for the
rows it gathers, unless it is tied to the LM head), read the in-window K/V of every
attention layer and write the new token's K/V, and read and write every recurrent
state once. Those bytes over the device's copy bandwidth (a large device-to-device
copy timed in the same run, counting bytes read plus bytes written) are the floor;
a measured step over it is the gap. Activations and logits are not counted (they are
small next to the rest at these shapes). Computed from the model config alone,
independently of the engine's own allocation arithmetic.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

from hybrid_jax.config import LayerKind, ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def decode_floor_bytes(cfg: ModelConfig, *, batch: int, context: int, weight_bytes: int,
                       dtype: str, state_dtype: str = "float32") -> dict[str, int]:
    """Bytes one decode step of `batch` sequences at `context` cached tokens must move."""
    kv_b, st_b = DTYPE_BYTES[dtype], DTYPE_BYTES[state_dtype]
    weights = weight_bytes
    if not cfg.tie_embeddings:  # the input table is gathered, not read whole
        weights -= cfg.vocab_size * cfg.hidden_size * kv_b
        weights += batch * cfg.hidden_size * kv_b
    kv = state = 0
    for spec in cfg.layers:
        if spec.kind.has_attention:
            a = cfg.attention
            seen = context + 1 if spec.window is None else min(context + 1, spec.window)
            kv += batch * seen * 2 * a.num_kv_heads * a.head_dim * kv_b  # read (the new one written)
        if spec.kind.has_mamba2:
            m = cfg.mamba2
            state += 2 * batch * m.num_heads * m.head_dim * m.state_size * st_b
            state += 2 * batch * (m.conv_kernel - 1) * m.conv_dim * kv_b
        if spec.kind == LayerKind.RGLRU:
            r = cfg.rglru
            state += 2 * batch * (r.width * 4 + (r.conv_kernel - 1) * r.width * kv_b)
    return {"weights": weights, "kv": kv, "state": state, "total": weights + kv + state}


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Bytes/s (read + write) of an elementwise pass over an `nbytes` f32 buffer.

    Each sample times 10 passes back to back (one sync: a per-call sync costs the small
    buffers of CPU smoke runs most of their time); the median of `reps` samples.
    """
    n = max(1, nbytes // 4)
    x = jnp.arange(n, dtype=jnp.float32)
    step = jax.jit(lambda a: a + 1.0)
    step(x).block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(10):
            y = step(x)
        y.block_until_ready()
        times.append((time.perf_counter() - t) / 10)
    del x
    return 2 * n * 4 / statistics.median(times)


def floor_report(cfg: ModelConfig, *, batch: int, context: int, weight_bytes: int, dtype: str,
                 step_s: float, bandwidth: float, state_dtype: str = "float32") -> dict[str, float]:
    """The floor (bytes, ms) of one decode step and the measured step's ratio to it."""
    b = decode_floor_bytes(cfg, batch=batch, context=context, weight_bytes=weight_bytes, dtype=dtype,
                           state_dtype=state_dtype)
    floor_s = b["total"] / bandwidth
    return {"floor_bytes": b["total"], "floor_weights_bytes": b["weights"], "floor_kv_bytes": b["kv"],
            "floor_state_bytes": b["state"], "floor_ms": 1e3 * floor_s, "gap_x": step_s / floor_s}
