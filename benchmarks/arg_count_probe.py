"""Host enqueue time of one executable call against its number of donated arguments.

The engine's decode step took 112 arguments, 96 of them per-layer caches (K and V
pages, conv and SSM state of 24 layers), and the host needed 0.55-1.0 ms to enqueue it on
the H100 hosts (since the caches are stacked by kind, hybrid_jax/cache.py, it takes 20).
This probe separates the per-argument share from the rest: the same
jitted chain of per-layer updates (a dynamic slice of one slot row, tanh, a dynamic
update back: ~3 small kernels per buffer) is called on

  separate  L * K donated buffers [S, 8, 1024] f32 (one per layer and kind, as now)
  stacked   K donated buffers [L, S, 8, 1024] f32 (a stacked pool per kind, each layer
            reading and writing its row)

with the same kernels and bytes. It prints, per variant, the host time for a call to
return (`enqueue_ms`, median, the device idle before the call), the call through to its
result (`call_ms`) and calls back to back (`back_to_back_ms`), then the per-argument
cost: (enqueue separate - enqueue stacked) / (argument count difference).

  PYTHONPATH=. python benchmarks/arg_count_probe.py [--layers 24] [--kinds 4] [--reps 300]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

SHAPE = (64, 8, 1024)  # [slots, 8, 1024] f32: 2 MiB per layer buffer


def _chain(stacked: bool, layers: int, kinds: int):
    def f(bufs, slot, x):
        bufs, h = list(bufs), x
        for layer in range(layers):
            for k in range(kinds):
                if stacked:
                    b = bufs[k]
                    row = jax.lax.dynamic_slice(b, (layer, slot[0], 0, 0), (1, 1) + SHAPE[1:])[0, 0]
                    h = jnp.tanh(h + row)
                    bufs[k] = jax.lax.dynamic_update_slice(b, h[None, None], (layer, slot[0], 0, 0))
                else:
                    i = layer * kinds + k
                    row = jax.lax.dynamic_slice(bufs[i], (slot[0], 0, 0), (1,) + SHAPE[1:])[0]
                    h = jnp.tanh(h + row)
                    bufs[i] = jax.lax.dynamic_update_slice(bufs[i], h[None], (slot[0], 0, 0))
        return tuple(bufs), h
    return jax.jit(f, donate_argnums=(0,))


def run(stacked: bool, layers: int, kinds: int, reps: int) -> dict:
    if stacked:
        bufs = tuple(jnp.zeros((layers,) + SHAPE, jnp.float32) for _ in range(kinds))
    else:
        bufs = tuple(jnp.zeros(SHAPE, jnp.float32) for _ in range(layers * kinds))
    slot, x = jnp.array([3], jnp.int32), jnp.ones(SHAPE[1:], jnp.float32)
    fn = _chain(stacked, layers, kinds)
    bufs, h = fn(bufs, slot, x)
    h.block_until_ready()
    enq, tot = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        bufs, h = fn(bufs, slot, x)
        t1 = time.perf_counter()
        h.block_until_ready()
        enq.append(t1 - t0)
        tot.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(reps):
        bufs, h = fn(bufs, slot, x)
    h.block_until_ready()
    return {"variant": "stacked" if stacked else "separate", "args": len(bufs) + 2,
            "enqueue_ms": 1e3 * float(np.median(enq)), "call_ms": 1e3 * float(np.median(tot)),
            "back_to_back_ms": 1e3 * (time.perf_counter() - t0) / reps, "device": str(jax.devices()[0])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--kinds", type=int, default=4, help="buffers per layer (K, V, conv, SSM state)")
    p.add_argument("--reps", type=int, default=300, help="timed calls per variant")
    p.add_argument("--rounds", type=int, default=2, help="separate / stacked pairs run")
    a = p.parse_args()
    rows = []
    for _ in range(a.rounds):
        for stacked in (False, True):
            rows.append(run(stacked, a.layers, a.kinds, a.reps))
            print(json.dumps(rows[-1]), flush=True)
    sep = np.median([r["enqueue_ms"] for r in rows if r["variant"] == "separate"])
    stk = np.median([r["enqueue_ms"] for r in rows if r["variant"] == "stacked"])
    extra = a.layers * a.kinds - a.kinds
    print(json.dumps({"per_argument_us": 1e3 * float(sep - stk) / extra, "arguments_saved": extra,
                      "enqueue_saved_ms": float(sep - stk)}))


if __name__ == "__main__":
    main()
