"""Time the MLA latent decode kernel (`pallas_kernels/mla_decode.py`) against its XLA reference.

Kimi-Linear-48B-A3B's MLA at TP = 1: h = 32 query heads, latent rows of L = 512 + 64 values
(bf16), pages of 16 tokens (the engine's default page size), page table as wide as the
context (a global layer's ring: max_model_len / page size columns). Rows, for batch 1, 16
and 64 at context 4096 and 32768 (every sequence at that length):

- the kernel at its default tuning (`mla_tuning`), and under `--sweep` one-field
  deviations from it (rows per program, tile tokens, warps, stages, splits);
- the reference (`impl="reference"`: what the engine ran before the kernel; it gathers
  the whole ring of every sequence, K and V);
- verification (3 queries per sequence: MTP with 2 drafts) at context 4096.

Each row: median time per call, the byte floor (the latent rows the call must read,
b x context x L x 2 bytes, over the device copy bandwidth measured at start with
`serving.entrypoints.bench.floor.copy_bandwidth`), the ratio to it, and the kernel's
max |error| against the reference.

    PYTHONPATH=. python benchmarks/mla_decode.py [--sweep] [--out mla_decode.json]
    PYTHONPATH=. python benchmarks/mla_decode.py --tiny     # CPU: tiny shapes, interpret mode

Knows nothing of the engine: the shapes are the published model's.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks.attention_inputs import time_fn
from pallas_kernels.mla_decode import MLATuning, mla_decode, mla_tuning
from serving.entrypoints.bench.floor import copy_bandwidth

FULL = dict(heads=32, rank=512, rope=64, page=16, batches=(1, 16, 64), contexts=(4096, 32768),
            verify=3, copy=1 << 30, impl="pallas")
TINY = dict(heads=3, rank=32, rope=16, page=8, batches=(1, 3), contexts=(40,), verify=2,
            copy=1 << 16, impl="interpret")
SWEEP = [dict(rows=16), dict(tile_tokens=32), dict(num_warps=4), dict(num_stages=2),
         dict(splits=1)]


def inputs(key, cfg, batch: int, context: int, queries: int):
    """(q [b * n, h, L], pages [1, N, s, L], lengths, page_table): every sequence holds
    `context` tokens on distinct random pages (page 0 the dummy)."""
    s, width = cfg["page"], cfg["rank"] + cfg["rope"]
    cols = -(-context // s)
    kq, kp, kt = jax.random.split(key, 3)
    pages = jax.random.normal(kp, (1, 1 + batch * cols, s, width), jnp.bfloat16)
    table = (1 + jax.random.permutation(kt, batch * cols)).reshape(batch, cols).astype(jnp.int32)
    q = jax.random.normal(kq, (batch * queries, cfg["heads"], width), jnp.bfloat16)
    return q, pages, jnp.full((batch,), context, jnp.int32), table


def run(cfg, sweep: bool) -> list[dict]:
    bandwidth = copy_bandwidth(cfg["copy"])
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; copy bandwidth "
          f"{bandwidth / 1e12:.3f} TB/s (read + write)", flush=True)
    rows, key = [], jax.random.key(0)
    width = cfg["rank"] + cfg["rope"]
    shapes = [(b, c, 1) for c in cfg["contexts"] for b in cfg["batches"]]
    shapes += [(b, cfg["contexts"][0], cfg["verify"]) for b in cfg["batches"]]
    for batch, context, n in shapes:
        key, sub = jax.random.split(key)
        args = inputs(sub, cfg, batch, context, n)
        common = dict(rank=cfg["rank"], scale=width ** -0.5, queries=n)
        floor_s = batch * context * width * 2 / bandwidth
        ref = jax.jit(functools.partial(mla_decode, **common, impl="reference"))
        want = ref(*args).astype(jnp.float32)
        tag = f"b={batch} ctx={context} q={n}"
        base = mla_tuning(batch, n, cfg["heads"], cfg["rank"], args[1], args[3])
        variants = [base] + ([dataclasses.replace(base, **v) for v in SWEEP] if sweep else [])
        for t in dict.fromkeys(variants):  # no duplicates (a sweep entry equal to the default)
            fn = jax.jit(functools.partial(mla_decode, **common, impl=cfg["impl"], tuning=t))
            try:
                err = float(jnp.max(jnp.abs(fn(*args).astype(jnp.float32) - want)))
            except jax.errors.JaxRuntimeError as exc:  # e.g. shared memory: report, go on
                print(f"{tag} {t} FAILED: {str(exc)[:160]}", flush=True)
                continue
            rows.append(_row(f"{tag} kernel {_name(t, base)}", time_fn(fn, *args), floor_s, err))
        rows.append(_row(f"{tag} XLA reference", time_fn(ref, *args), floor_s, None))
        del args, want
    return rows


def _name(t: MLATuning, base: MLATuning) -> str:
    if t == base:
        return f"default ({t.rows} rows, {t.tile_tokens} tokens, {t.num_warps} warps, " \
               f"{t.num_stages} stages, {t.splits} splits)"
    return " ".join(f"{f.name}={getattr(t, f.name)}" for f in dataclasses.fields(t)
                    if getattr(t, f.name) != getattr(base, f.name))


def _row(name: str, seconds: float, floor_s: float, err: float | None) -> dict:
    row = {"name": name, "us": seconds * 1e6, "floor_us": floor_s * 1e6, "x_floor": seconds / floor_s,
           "max_err": err}
    note = "" if err is None else f"  max|err| {err:.1e}"
    print(f"{name:<88} {row['us']:10.1f} us  floor {row['floor_us']:8.1f} us  "
          f"{row['x_floor']:6.2f}x{note}", flush=True)
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", "--smoke", action="store_true",
                   help="tiny shapes in interpret mode (CPU check of this script)")
    p.add_argument("--sweep", action="store_true", help="also one-field deviations from the default tuning")
    p.add_argument("--out", help="write the rows as JSON here")
    a = p.parse_args()
    cfg = TINY if a.tiny else FULL
    if not a.tiny and jax.default_backend() != "gpu":
        p.error("the full shapes need a GPU (use --tiny on a CPU)")
    rows = run(cfg, a.sweep)
    if a.out:
        Path(a.out).write_text(json.dumps({"device": jax.devices()[0].device_kind,
                                           "jax": jax.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
