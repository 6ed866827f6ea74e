"""What start-up's serial lowering costs per executable, measured on any machine.

Lowers the engine's step executables for the GPU (`lowering_platforms=("cuda",)`, Pallas
kernels through Triton and Mosaic GPU, the GPU's bucket ladder and code paths) on the
machine it runs on, a CPU included: the model, the caches and the runner's device
arrays are abstract (nothing is allocated), and the GPU-only choices are made as an
H100 makes them (`jax.default_backend()` reads "gpu", the Hopper stream GEMM on). Prints
per executable the seconds spent tracing and lowering (jaxpr -> StableHLO, the serial
part of a cold start-up) and how many `pallas_call` / Mosaic GPU kernels were lowered
(each costs tens of ms) against how many the module holds.

  PYTHONPATH=. python benchmarks/lowering_cost.py [--model native-1b-parallel] [--only decode|mixed]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import time

os.environ.setdefault("HYBRID_JAX_KERNELS", "pallas")
os.environ.setdefault("HYBRID_JAX_EXECUTABLE_STORE", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

jax.default_backend = lambda: "gpu"  # the project's GPU choices (bucket ladder, kernels)

from hybrid_jax.layers import linear  # noqa: E402

# The H100 runs gated MLPs' decode products through the Mosaic GPU stream GEMM; its
# lowering needs jax 0.11 (on 0.10 Mosaic GPU refuses its transposed swizzled tiles), so
# it is on only with --stream-gemm. It lowers once per executable either way (one kernel
# for every layer: pallas_kernels/stream_gemm.py `_row_operand`).
linear._hopper = lambda: os.environ.get("LOWERING_COST_STREAM_GEMM") == "1"


def _counters() -> dict[str, list[float]]:
    """Wrap the GPU pallas_call lowerings (Triton; Mosaic GPU): seconds of each call."""
    import jax._src.pallas.mosaic_gpu.pallas_call_registration  # noqa: F401  (registers its rule)
    import jax._src.pallas.triton.pallas_call_registration  # noqa: F401
    from jax._src.pallas import core as pallas_core

    spent: dict[str, list[float]] = {"triton": [], "mosaic_gpu": []}
    for cls, (rule, platform) in list(pallas_core._backend_lowering_rules.items()):
        if platform != "gpu":
            continue
        name = "triton" if "triton" in cls.__module__ else "mosaic_gpu"

        def timed(*a, _rule=rule, _name=name, **k):
            t = time.perf_counter()
            try:
                return _rule(*a, **k)
            finally:
                spent[_name].append(time.perf_counter() - t)
        pallas_core._backend_lowering_rules[cls] = (timed, platform)
    return spent


def _abstract(tree):
    """Arrays and tracers -> shapes without a sharding (lowered for no particular device)."""
    def one(x):
        if isinstance(x, jax.ShapeDtypeStruct) or not (hasattr(x, "shape") and hasattr(x, "dtype")):
            return x
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax.tree.map(one, tree)


def build_runner(model_name: str, dtype: str, max_num_seqs: int, max_tokens: int, num_pages: int,
                 layers: int = 0):
    """A ModelRunner traced abstractly (jax.eval_shape): its arrays come out as shapes."""
    from hybrid_jax.model import CausalLM
    from hybrid_jax.presets import load_preset
    from serving.core.block_table import ring_width
    from serving.runner.runner import ModelRunner

    cfg = load_preset(model_name)
    if layers:  # the first `layers` layers only: what each further layer costs
        cfg = dataclasses.replace(cfg, layers=cfg.layers[:layers])
    box = {}

    def make():
        model = CausalLM(cfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0))
        rw = tuple(ring_width(w, 16, 2048, 8192) for w in cfg.windows)
        box["r"] = ModelRunner(model, num_pages=(num_pages,) * len(rw), page_size=16,
                               num_slots=max_num_seqs + 1, ring_widths=rw, max_num_seqs=max_num_seqs,
                               max_num_batched_tokens=max_tokens)
        return 0

    jax.eval_shape(make)
    r = box["r"]
    for name, value in list(vars(r).items()):
        if name in ("params", "caches", "stats", "last_tokens", "ckpts", "mtp_caches"):
            setattr(r, name, _abstract(value))
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="native-1b-parallel")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--num-pages", type=int, default=4096)
    p.add_argument("--only", choices=("decode", "mixed"), default=None)
    p.add_argument("--layers", type=int, default=0, help="keep only the first N layers")
    p.add_argument("--limit", type=int, default=0, help="lower at most this many executables")
    p.add_argument("--stream-gemm", action="store_true", help="the Mosaic GPU stream GEMM (jax >= 0.11)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.stream_gemm:
        os.environ["LOWERING_COST_STREAM_GEMM"] = "1"
    spent = _counters()
    t0 = time.perf_counter()
    r = build_runner(a.model, a.dtype, a.max_num_seqs, a.max_num_batched_tokens, a.num_pages, a.layers)
    build_s = time.perf_counter() - t0
    jobs = []
    import serving.runner.runner as runner_mod

    runner_mod.compile_jobs = lambda todo, **kw: jobs.extend(todo) or {}
    r.compile_all()
    rows = []
    for key, lower, _, _ in jobs:
        if a.only == "decode" and not (getattr(key, "decode", False)):
            continue
        if a.only == "mixed" and not (hasattr(key, "decode") and not key.decode):
            continue
        if a.limit and len(rows) >= a.limit:
            break
        # The job lowers `fn.lower(*args)` for this machine: take fn and args from its closure.
        cells = (c.cell_contents for c in lower.__closure__)
        free = dict(zip(lower.__code__.co_freevars, cells, strict=True))
        fn, args = free["fn"], _abstract(free["args"])
        n0 = {k: len(v) for k, v in spent.items()}
        s0 = {k: sum(v) for k, v in spent.items()}
        t = time.perf_counter()
        traced = fn.trace(*args)
        t_trace = time.perf_counter() - t
        low = traced.lower(lowering_platforms=("cuda",))
        t_lower = time.perf_counter() - t - t_trace
        text = low.as_text()
        row = {"key": repr(key), "trace_s": round(t_trace, 3), "lower_s": round(t_lower, 3),
               "triton_lowered": len(spent["triton"]) - n0["triton"],
               "mosaic_lowered": len(spent["mosaic_gpu"]) - n0["mosaic_gpu"],
               "kernel_lower_s": round(sum(sum(v) - s0[k] for k, v in spent.items()), 3),
               "triton_calls": len(re.findall(r"__gpu\$xla\.gpu\.triton", text)),
               "mosaic_calls": len(re.findall(r"mosaic_gpu", text)),
               "module_chars": len(text)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    total = {"model": a.model, "build_s": round(build_s, 1), "executables": len(rows),
             "trace_s": round(sum(x["trace_s"] for x in rows), 2),
             "lower_s": round(sum(x["lower_s"] for x in rows), 2),
             "triton_lowered": sum(x["triton_lowered"] for x in rows),
             "mosaic_lowered": sum(x["mosaic_lowered"] for x in rows)}
    print(json.dumps(total))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"rows": rows, "total": total}, f, indent=1)


if __name__ == "__main__":
    main()
