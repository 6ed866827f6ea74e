"""Time the Gated DeltaNet kernels on a GPU against flash-linear-attention, in one process.

Rows (Qwen3-Next's heads: 16 key heads, 32 value heads, dk = dv = 128; bf16 q, k, v;
g float32; beta the float32 value of a bf16 sigmoid, as the model has them):
- prefill `gated_delta_ragged` (Pallas pipeline, and its three stages as prefixes) at
  4 x 4096 and 1 x 16384 tokens, every sequence from an f32 slot state; tok/s, TFLOP/s of
  the chunk form's dots and the byte floor (inputs, output, states once);
- decode `gated_delta_step`, one token, f32 state pool, batch 64 and 256 (state donated,
  updated in place): bytes = the touched states read + written (plus the small inputs),
  against the device copy bandwidth measured at start; and the 3-token `candidates`
  variant (speculative verification with 2 drafts);
- the anchors `chunk_gated_delta_rule` and `fused_recurrent_gated_delta_rule` from a local
  copy of flash-linear-attention's `fla/` package under `--anchors` (default .anchors:
  the lead copies it there; see docs/kernels.md), on the same inputs, torch CUDA events.

Every Pallas output is compared on the GPU with the pure-JAX chunked reference (prefill)
or the sequential step (decode), and with the anchor's output where it ran
(max-normalised error; bf16 dots on both sides).

    PYTHONPATH=. python benchmarks/gated_delta.py [--what prefill|decode] [--variants] [--out r.json]
    PYTHONPATH=. python benchmarks/gated_delta.py --smoke     # CPU: interpret mode, tiny

Knows nothing of models: the shapes are the issue's targets.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import gated_delta_decode, gated_delta_prefill  # noqa: E402
from pallas_kernels.gated_delta import gated_delta_ragged, gated_delta_step  # noqa: E402
from serving.entrypoints.bench.probe import time_chained  # noqa: E402

F32, BF16 = jnp.float32, jnp.bfloat16
FULL = dict(prefill=((4096,) * 4, (16384,)), decode=(64, 256), hk=16, hv=32, d=128,
            copy=256 * 2**20, l=64, impl="pallas")
SMOKE = dict(prefill=((40, 24), (64,)), decode=(2,), hk=2, hv=4, d=16, copy=2**16, l=16,
             impl="interpret")


timeit = time_chained  # (seconds, out, state)


def copy_tbps(n):
    x = jax.random.normal(jax.random.PRNGKey(0), (n,), F32)
    copy = jax.jit(lambda v: v * 1.0001)
    t, _, _ = timeit(lambda s: (lambda r: (r, r))(copy(s)), x, (), 5, 10)
    return 2 * x.nbytes / t / 1e12


def err(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.abs(got - want).max() / max(float(np.abs(want).max()), 1e-6))


def make_inputs(seed, lead, cfg):
    """q, k (L2-normalised), v bf16; g f32 log decay; beta f32 (bf16-exact sigmoid)."""
    hk, hv, d = cfg["hk"], cfg["hv"], cfg["d"]
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = unit(jax.random.normal(ks[0], (*lead, hk, d), F32)).astype(BF16)
    k = unit(jax.random.normal(ks[1], (*lead, hk, d), F32)).astype(BF16)
    v = jax.random.normal(ks[2], (*lead, hv, d), F32).astype(BF16)
    g = jax.nn.log_sigmoid(jax.random.normal(ks[3], (*lead, hv), F32) + 3.0)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (*lead, hv), F32)).astype(BF16).astype(F32)
    return q, k, v, g, beta


class Anchor:
    """flash-linear-attention's ops from a local copy (None where torch/CUDA/fla is absent)."""

    def __init__(self, path):
        self.error = None
        try:
            sys.path.append(os.path.abspath(path))  # an installed einops wins over the copy's
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError("torch sees no CUDA device")
            from fla.ops.gated_delta_rule import (
                chunk_gated_delta_rule,
                fused_recurrent_gated_delta_rule,
            )
        except Exception as e:  # report why and go on with our kernels
            self.error = f"{type(e).__name__}: {e}"
            return
        self.torch, self.chunk, self.recurrent = torch, chunk_gated_delta_rule, \
            fused_recurrent_gated_delta_rule

    def tensor(self, x, dtype=None):
        t = self.torch.from_numpy(np.asarray(x, np.float32).copy()).cuda()
        return t.to(dtype or self.torch.float32)

    def time(self, fn, reps, inner):
        torch = self.torch
        for _ in range(2):
            out = fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(inner):
                out = fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3 / inner)
        return statistics.median(times), out


def _prefill_call(states, q, k, v, g, beta, cu, slots, init, *, scale, l, impl, stages,
                  **tuning):
    out = gated_delta_prefill.gated_delta_prefill_pallas(
        q, k, v, g, beta, cu, states, slots, init, scale=scale, chunk_size=l, impl=impl,
        stages=stages, **tuning)
    if stages == 1:
        return out, states
    return (out[0], out[1]) if stages == 3 else (out[:2], out[2])


def bench_prefill(rows, cfg, anchor, args):
    hk, hv, d, l = cfg["hk"], cfg["hv"], cfg["d"], cfg["l"]
    scale = d ** -0.5
    variants = [dict(pass_block_v=gated_delta_prefill.PASS_BLOCK_V,
                     out_block_v=gated_delta_prefill.OUT_BLOCK_V, warps=gated_delta_prefill.WARPS,
                     pass_stages=gated_delta_prefill.PASS_STAGES)]
    if args.variants:
        variants += [dict(variants[0], **kw) for kw in (
            dict(pass_block_v=16), dict(pass_block_v=64), dict(out_block_v=64),
            dict(pass_stages=2), dict(pass_stages=3), dict(warps=(1, 4, 4)),
            dict(warps=(4, 4, 4)), dict(warps=(2, 2, 4)), dict(warps=(2, 4, 2)),
            dict(warps=(2, 8, 4)), dict(pass_block_v=64, warps=(2, 4, 2)))]
    for lens in cfg["prefill"]:
        t, b = sum(lens), len(lens)
        q, k, v, g, beta = make_inputs(1, (t,), cfg)
        cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
        slots = jnp.arange(1, b + 1, dtype=jnp.int32)[::-1]
        init = jnp.ones((b,), bool)
        pool = jax.random.normal(jax.random.PRNGKey(2), (b + 1, hv, d, d), F32) * 0.1
        shape = f"{b}x{lens[0]} hk{hk} hv{hv} d{d} l{l}"
        common = (q, k, v, g, beta, cu, slots, init)
        flops = t * hv * (6 * d * d + 2 * l * 5 * d)
        nbytes = (2 * q.nbytes + 2 * v.nbytes + g.nbytes + beta.nbytes + 2 * b * hv * d * d * 4)
        want_o, want_s = gated_delta_ragged(*common[:6], pool, slots, init, scale=scale,
                                            chunk_size=l, impl="reference")
        for vi, tuning in enumerate(variants):
            for stages in (1, 2, 3) if vi == 0 else (3,):
                fn = jax.jit(functools.partial(_prefill_call, scale=scale, l=l, impl=cfg["impl"],
                                               stages=stages, **tuning), donate_argnums=0)
                sec, out, _ = timeit(fn, pool.copy(), common, args.reps, args.inner)
                row = dict(kernel="gdn_prefill", shape=shape, impl=f"pallas stages<={stages}",
                           tuning=str(tuning), us=sec * 1e6)
                if stages == 3:
                    # the timed call chained the pool: rerun once from the original pool
                    o, s = fn(pool.copy(), *common)
                    row.update(Mtok_s=t / sec / 1e6, TFLOPs=flops / sec / 1e12,
                               floor_TBs=nbytes / sec / 1e12, err_o=err(o, want_o),
                               err_state=err(s[slots], want_s[slots]))
                rows.append(row)
                print(row, flush=True)
        if anchor.error is None:
            rows.append(_anchor_prefill(anchor, common, pool, lens, shape, scale, want_o,
                                        want_s, args))
            print(rows[-1], flush=True)


def _anchor_prefill(anchor, common, pool, lens, shape, scale, want_o, want_s, args):
    torch = anchor.torch
    q, k, v, g, beta, cu, slots, _ = common
    tq = lambda x, dt=torch.bfloat16: anchor.tensor(x, dt)[None]  # noqa: E731  [1, t, ...]
    args_t = (tq(q), tq(k), tq(v), tq(g, torch.float32), tq(beta))
    h0 = anchor.tensor(pool[slots])
    cu_t = torch.tensor(np.asarray(cu), dtype=torch.long, device="cuda")
    fn = lambda: anchor.chunk(*args_t, scale=scale, initial_state=h0,  # noqa: E731
                              output_final_state=True, cu_seqlens=cu_t)
    sec, (o, ht) = anchor.time(fn, args.reps, args.inner)
    t = sum(lens)
    return dict(kernel="gdn_prefill", shape=shape, impl="fla chunk_gated_delta_rule",
                us=sec * 1e6, Mtok_s=t / sec / 1e6,
                err_o=err(o[0].float().cpu().numpy(), want_o),
                err_state=err(ht.float().cpu().numpy(), want_s[slots]))


def bench_decode(rows, cfg, anchor, copy, args):
    hk, hv, d = cfg["hk"], cfg["hv"], cfg["d"]
    scale = d ** -0.5
    variants = [None]
    if args.variants:
        variants += [dict(block_v=bv, num_warps=w) for bv in (16, 32, 64, 128) for w in (2, 4, 8)]
    for bsz in cfg["decode"]:
        for n, cand in ((1, False), (3, True)):
            q, k, v, g, beta = make_inputs(3, (bsz, n), cfg)
            slots = jnp.asarray(np.random.default_rng(0).permutation(np.arange(1, bsz + 1)),
                                jnp.int32)
            pool = jax.random.normal(jax.random.PRNGKey(4), (bsz + 1, hv, d, d), F32) * 0.1
            common = (q, k, v, g, beta, slots)
            state_bytes = bsz * hv * d * d * 4
            # states read once, written once (or n candidates); q, k, v read, o written
            nbytes = state_bytes * (1 + n if cand else 2) + q.nbytes + k.nbytes + 2 * v.nbytes
            want = gated_delta_step(q, k, v, g, beta, pool, slots, scale=scale,
                                    candidates=cand, impl="reference")
            shape = f"b{bsz} n{n} hk{hk} hv{hv} d{d} f32" + (" candidates" if cand else "")
            for tuning in variants if not cand else variants[:1]:
                fn = jax.jit(functools.partial(_decode_call, scale=scale, cand=cand,
                                               impl=cfg["impl"], tuning=tuning), donate_argnums=0)
                sec, _, _ = timeit(fn, pool.copy(), common, args.reps, args.inner)
                o, s = fn(pool.copy(), *common)
                if cand:
                    o, s = o  # (o, candidates), the pool passed through
                got_s, want_s = (s, want[1]) if cand else (s[slots], want[1][slots])
                row = dict(kernel="gdn_decode", shape=shape, impl="pallas", tuning=str(tuning),
                           us=sec * 1e6, TBs=nbytes / sec / 1e12,
                           pct_copy=100 * nbytes / sec / 1e12 / copy,
                           err_o=err(o, want[0]), err_state=err(got_s, want_s))
                rows.append(row)
                print(row, flush=True)
            if anchor.error is None and not cand:
                rows.append(_anchor_decode(anchor, common, pool, shape, scale, nbytes, copy, want,
                                           args))
                print(rows[-1], flush=True)


def _decode_call(states, q, k, v, g, beta, slots, *, scale, cand, impl, tuning):
    if tuning is None:
        o, s = gated_delta_step(q, k, v, g, beta, states, slots, scale=scale, candidates=cand,
                                impl=impl)
    else:
        o, s = gated_delta_decode.gated_delta_step_pallas(
            q, k, v, g, beta, states, slots, scale=scale, candidates=cand, impl=impl, **tuning)
    return (o, s) if not cand else ((o, s), states)


def _anchor_decode(anchor, common, pool, shape, scale, nbytes, copy, want, args):
    torch = anchor.torch
    q, k, v, g, beta, slots = common
    tt = lambda x, dt=torch.bfloat16: anchor.tensor(x, dt)  # noqa: E731  [b, 1, ...]
    args_t = (tt(q), tt(k), tt(v), tt(g, torch.float32))
    h0, bt = anchor.tensor(pool[slots]), tt(beta)
    fn = lambda: anchor.recurrent(*args_t, beta=bt, scale=scale,  # noqa: E731
                                  initial_state=h0, output_final_state=True)
    sec, (o, ht) = anchor.time(fn, args.reps, args.inner)
    return dict(kernel="gdn_decode", shape=shape, impl="fla fused_recurrent_gated_delta_rule",
                us=sec * 1e6, TBs=nbytes / sec / 1e12, pct_copy=100 * nbytes / sec / 1e12 / copy,
                err_o=err(o.float().cpu().numpy(), want[0]),
                err_state=err(ht.float().cpu().numpy(), want[1][slots]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU)")
    ap.add_argument("--variants", action="store_true", help="also sweep the launch tunings")
    ap.add_argument("--what", choices=("all", "prefill", "decode"), default="all")
    ap.add_argument("--anchors", default=".anchors", help="folder holding fla/ (and einops/)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--inner", type=int, default=10)
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    cfg = SMOKE if args.smoke else FULL
    if args.smoke:
        args.reps, args.inner = 1, 1
    anchor = Anchor(args.anchors)
    copy = copy_tbps(cfg["copy"])
    print(f"device {jax.devices()[0].device_kind}; copy {copy:.2f} TB/s; anchor: "
          f"{anchor.error or 'fla from ' + args.anchors}", flush=True)
    rows = []
    if args.what in ("all", "prefill"):
        bench_prefill(rows, cfg, anchor, args)
    if args.what in ("all", "decode"):
        bench_decode(rows, cfg, anchor, copy, args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, copy_TBs=copy,
                           anchor_error=anchor.error, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
