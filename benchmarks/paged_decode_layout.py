"""Does the page layout matter to the paged decode kernel? (GPU; B=256, context 312.)

Times `paged_attention_decode` (the engine's launch) from a jax.profiler trace, in a
chain of 8 calls on distinct queries and page tables, for: a compact pool with each
sequence's pages in order or at random, a 60k-page pool (the engine's size at batch
256) with a 161-column ring table, in order or at random, and with a GEMM between the
calls. Prints one JSON line per variant (kernel microseconds per call).

    PYTHONPATH=. python benchmarks/paged_decode_layout.py [--smoke]
"""
import json
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged_attention import paged_attention_decode
from serving.entrypoints.bench.trace_report import gpu_kernel_events

B, CTX, W, H, K, E, S = 256, 312, 2048, 16, 4, 128, 16
smoke = "--smoke" in sys.argv
if smoke:
    B, CTX = 4, 40
CALLS = 8
rng = np.random.default_rng(0)
pages_per = -(-CTX // S)

def tables(n_pages, width, mode, call):
    t = np.zeros((B, width), np.int32)
    for i in range(B):
        if mode == "seq":
            base = 1 + (call * B + i) * pages_per
            pg = base + np.arange(pages_per)
        else:
            pg = rng.choice(np.arange(1, n_pages), pages_per, replace=False)
        t[i, np.arange(pages_per) % width] = pg
    return jnp.asarray(t)

def run(name, n_pages, width, mode, gemm):
    kp = jax.random.normal(jax.random.key(1), (K, n_pages, S, E), jnp.bfloat16)
    vp = jax.random.normal(jax.random.key(2), (K, n_pages, S, E), jnp.bfloat16)
    qs = [jax.random.normal(jax.random.key(10 + c), (B, H, E), jnp.bfloat16) for c in range(CALLS)]
    tbs = [tables(n_pages, width, mode, c) for c in range(CALLS)]
    lens = jnp.full((B,), CTX, jnp.int32)
    w1 = jax.random.normal(jax.random.key(3), (2048, 8192), jnp.bfloat16)
    impl = "interpret" if smoke else None
    @jax.jit
    def chain(qs, tbs, kp, vp, x):
        outs = []
        for q, tb in zip(qs, tbs, strict=True):
            if gemm:
                x = (x @ w1)[:, :2048].astype(jnp.bfloat16)
                q = q + x[:, :E][:, None, :] * 0
            kw = dict(window=W) | ({"impl": impl} if impl else {})
            outs.append(paged_attention_decode(q, kp, vp, lens, tb, **kw))
        return outs, x
    x = jnp.ones((B, 2048), jnp.bfloat16)
    jax.block_until_ready(chain(qs, tbs, kp, vp, x))
    jax.block_until_ready(chain(qs, tbs, kp, vp, x))
    d = tempfile.mkdtemp()
    jax.profiler.start_trace(d)
    for _ in range(3):
        out = chain(qs, tbs, kp, vp, x)
    jax.block_until_ready(out)
    jax.profiler.stop_trace()
    pd = [ev.duration_ns for _, ev in gpu_kernel_events(d) if "paged_decode" in ev.name]
    us = (sum(pd) / len(pd) / 1e3) if pd else None
    print(json.dumps({"variant": name, "n_pages": n_pages, "width": width, "mode": mode, "gemm": gemm,
                      "paged_decode_us": us, "count": len(pd)}), flush=True)

big = 4000 if smoke else 60000
compact = 1 + CALLS * B * pages_per
for args in [("compact seq", compact, pages_per, "seq", False),
             ("compact random", compact, pages_per, "random", False),
             ("big pool, T=161, seq", big, 161, "seq", False),
             ("big pool, T=161, random", big, 161, "random", False),
             ("big pool, T=161, seq, gemm between", big, 161, "seq", True),
             ("compact seq, gemm between", compact, pages_per, "seq", True)]:
    try:
        run(*args)
    except Exception as e:
        print("FAILED", args[0], repr(e)[:300], flush=True)
