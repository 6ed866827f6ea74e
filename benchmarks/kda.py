"""Time Kimi Delta Attention (per-channel decay) on a GPU against flash-linear-attention's KDA.

Rows (Kimi-Linear-48B-A3B's heads: 32 heads, dk = dv = 128; bf16 q, k, v; g float32 per
channel; beta the float32 value of a bf16 sigmoid):
- prefill `gated_delta_ragged` with g [t, h, dk]: the pure-JAX chunk form of
  pallas_kernels/kda_chunked.py (impl="reference": what the engine runs by default) and the
  Pallas pipeline of pallas_kernels/kda_prefill.py (what HYBRID_JAX_KDA_KERNEL=1 runs; its
  error against the chunked form) at 4 x 4096 and 1 x 16384 tokens from f32 slot states; tok/s;
- decode `gated_delta_step` with g [b, 1, h, dk] (the Pallas step kernel), f32 state pool,
  batch 64 and 256, and the 3-token candidates form; bytes = states read + written, against
  the device copy bandwidth measured at start;
- anchors `chunk_kda` / `fused_recurrent_kda` from a local copy of flash-linear-attention's
  `fla/` under `--anchors` (as benchmarks/gated_delta.py), same inputs, torch CUDA events.
Outputs are compared with the sequential reference (decode) or the chunked form (the anchor).

    PYTHONPATH=. python benchmarks/kda.py [--out kda.json]
    PYTHONPATH=. python benchmarks/kda.py --smoke     # CPU: tiny shapes, interpret mode

Knows nothing of models: the shapes are the published model's.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.gated_delta import Anchor, copy_tbps, err, timeit  # noqa: E402
from pallas_kernels.gated_delta import gated_delta_ragged, gated_delta_step  # noqa: E402

F32, BF16 = jnp.float32, jnp.bfloat16
FULL = dict(prefill=((4096,) * 4, (16384,)), decode=(64, 256), h=32, d=128, copy=256 * 2**20,
            l=64, impl="pallas")
SMOKE = dict(prefill=((40, 24),), decode=(2,), h=2, d=16, copy=2**16, l=16, impl="interpret")


def make_inputs(seed, lead, cfg):
    h, d = cfg["h"], cfg["d"]
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = unit(jax.random.normal(ks[0], (*lead, h, d), F32)).astype(BF16)
    k = unit(jax.random.normal(ks[1], (*lead, h, d), F32)).astype(BF16)
    v = jax.random.normal(ks[2], (*lead, h, d), F32).astype(BF16)
    g = jax.nn.log_sigmoid(jax.random.normal(ks[3], (*lead, h, d), F32) + 3.0)  # per channel
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (*lead, h), F32)).astype(BF16).astype(F32)
    return q, k, v, g, beta


def kda_anchor(path):
    """(torch, chunk_kda, fused_recurrent_kda) from a local fla copy, or the reason why not."""
    base = Anchor(path)  # checks torch, CUDA and the copy (its GDN ops)
    if base.error is not None:
        return base, None
    try:
        sys.path.append(os.path.abspath(path))
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
    except Exception as e:
        base.error = f"{type(e).__name__}: {e}"
        return base, None
    return base, (chunk_kda, fused_recurrent_kda)


def bench_prefill(rows, cfg, anchor, ops, args):
    for lens in cfg["prefill"]:
        _prefill_one(rows, cfg, anchor, ops, args, lens)


def _prefill_one(rows, cfg, anchor, ops, args, lens):
    h, d, l = cfg["h"], cfg["d"], cfg["l"]
    scale = d ** -0.5
    t, b = sum(lens), len(lens)
    q, k, v, g, beta = make_inputs(1, (t,), cfg)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    slots = jnp.arange(1, b + 1, dtype=jnp.int32)[::-1]
    init = jnp.ones((b,), bool)
    pool = jax.random.normal(jax.random.PRNGKey(2), (b + 1, h, d, d), F32) * 0.1
    common = (q, k, v, g, beta, cu, slots, init)
    shape = f"{b}x{lens[0]} h{h} d{d} l{l}"
    for impl, name in (("reference", "pure-JAX chunked"), (cfg["impl"], "Pallas kda_prefill")):
        fn = jax.jit(lambda st, *a, impl=impl: gated_delta_ragged(*a[:6], st, *a[6:], scale=scale,
                                                                  chunk_size=l, impl=impl),
                     donate_argnums=0)
        sec, _, _ = timeit(lambda st, *a, fn=fn: (lambda r: (r, r[1]))(fn(st, *a)), pool.copy(),
                           common, args.reps, args.inner)
        got_o, got_s = fn(pool.copy(), *common)
        if impl == "reference":
            o, s = got_o, got_s
            rows.append(dict(kernel="kda_prefill", shape=shape, impl=name, us=sec * 1e6,
                             Mtok_s=t / sec / 1e6))
        else:  # the kernel against the chunked form
            rows.append(dict(kernel="kda_prefill", shape=shape, impl=name, us=sec * 1e6,
                             Mtok_s=t / sec / 1e6, err_o=err(np.asarray(got_o), o),
                             err_state=err(np.asarray(got_s[slots]), s[slots])))
        print(rows[-1], flush=True)
    if ops is not None:
        torch = anchor.torch
        tq = lambda x, dt=torch.bfloat16: anchor.tensor(x, dt)[None]  # noqa: E731
        args_t = (tq(q), tq(k), tq(v), tq(g, torch.float32), tq(beta))
        h0 = anchor.tensor(pool[slots])
        cu_t = torch.tensor(np.asarray(cu), dtype=torch.long, device="cuda")
        call = lambda: ops[0](*args_t, scale=scale, initial_state=h0,  # noqa: E731
                              output_final_state=True, cu_seqlens=cu_t)
        sec, (ao, ah) = anchor.time(call, args.reps, args.inner)
        rows.append(dict(kernel="kda_prefill", shape=shape, impl="fla chunk_kda", us=sec * 1e6,
                         Mtok_s=t / sec / 1e6, err_o=err(ao[0].float().cpu().numpy(), o),
                         err_state=err(ah.float().cpu().numpy(), s[slots])))
        print(rows[-1], flush=True)


def bench_decode(rows, cfg, anchor, ops, copy, args):
    for bsz in cfg["decode"]:
        for n, cand in ((1, False), (3, True)):
            _decode_one(rows, cfg, anchor, ops, copy, args, bsz, n, cand)


def _decode_one(rows, cfg, anchor, ops, copy, args, bsz, n, cand):
    h, d = cfg["h"], cfg["d"]
    scale = d ** -0.5
    q, k, v, g, beta = make_inputs(3, (bsz, n), cfg)
    slots = jnp.asarray(np.random.default_rng(0).permutation(np.arange(1, bsz + 1)), jnp.int32)
    pool = jax.random.normal(jax.random.PRNGKey(4), (bsz + 1, h, d, d), F32) * 0.1
    common = (q, k, v, g, beta, slots)
    state_bytes = bsz * h * d * d * 4
    nbytes = state_bytes * (1 + n if cand else 2) + 3 * q.nbytes + g.nbytes + v.nbytes
    want = gated_delta_step(*common[:5], pool, slots, scale=scale, candidates=cand,
                            impl="reference")
    step = functools.partial(gated_delta_step, scale=scale, candidates=cand, impl=cfg["impl"])
    # (out, state) for time_chained: the output o and the pool (in place), or with candidates
    # (o, candidates) and the pool passed through. The pool must come back once: returned
    # twice, XLA writes a second copy of it on every call (the 2026-12-06 run's 223 us).
    fn = jax.jit(lambda st, *a: (lambda r: (r, st) if cand else r)(step(*a[:5], st, a[5])),
                 donate_argnums=0)
    sec, _, _ = timeit(fn, pool.copy(), common, args.reps, args.inner)
    o, s = fn(pool.copy(), *common)
    if cand:
        o, s = o
    got_s, want_s = (s, want[1]) if cand else (s[slots], want[1][slots])
    shape = f"b{bsz} n{n} h{h} d{d} f32" + (" candidates" if cand else "")
    rows.append(dict(kernel="kda_decode", shape=shape, impl="pallas", us=sec * 1e6,
                     TBs=nbytes / sec / 1e12, pct_copy=100 * nbytes / sec / 1e12 / copy,
                     err_o=err(o, want[0]), err_state=err(got_s, want_s)))
    print(rows[-1], flush=True)
    if ops is not None and not cand:
        torch = anchor.torch
        tt = lambda x, dt=torch.bfloat16: anchor.tensor(x, dt)  # noqa: E731
        h0 = anchor.tensor(pool[slots])
        args_t = (tt(q), tt(k), tt(v), tt(g, torch.float32), tt(beta))
        call = lambda: ops[1](*args_t, scale=scale, initial_state=h0,  # noqa: E731
                              output_final_state=True)
        sec, (ao, ah) = anchor.time(call, args.reps, args.inner)
        rows.append(dict(kernel="kda_decode", shape=shape, impl="fla fused_recurrent_kda",
                         us=sec * 1e6, TBs=nbytes / sec / 1e12,
                         pct_copy=100 * nbytes / sec / 1e12 / copy,
                         err_o=err(ao.float().cpu().numpy(), want[0]),
                         err_state=err(ah.float().cpu().numpy(), want[1][slots])))
        print(rows[-1], flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU)")
    ap.add_argument("--anchors", default=".anchors", help="folder holding fla/ (and einops/)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--inner", type=int, default=10)
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    cfg = SMOKE if args.smoke else FULL
    if args.smoke:
        args.reps, args.inner = 1, 1
    anchor, ops = kda_anchor(args.anchors)
    copy = copy_tbps(cfg["copy"])
    print(f"device {jax.devices()[0].device_kind}; copy {copy:.2f} TB/s; anchor: "
          f"{anchor.error or 'fla from ' + args.anchors}", flush=True)
    rows = []
    bench_prefill(rows, cfg, anchor, ops, args)
    bench_decode(rows, cfg, anchor, ops, copy, args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, copy_TBs=copy,
                           anchor_error=anchor.error, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
