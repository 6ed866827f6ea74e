"""Mamba1 selective-scan kernels at Falcon-Mamba-7B shapes against mamba_ssm's anchors.

Shapes (falcon-mamba-7b, one layer): d_inner c = 8192, state n = 16; x, dt, z, B, C bf16.
- prefill: 4 sequences x 4096 tokens packed (cu_seqlens), zero initial states, f32 states;
- decode: one token per sequence at batch 64 and 256, states f32 and bf16.

Ours: `selective_scan_ragged` / `selective_scan_step` (pallas_kernels/selective_scan.py)
with impl=pallas, and the pure-JAX references (`--reference`; the prefill reference holds
[t, c, n] f32 intermediates, 8.6 GB each at this shape).

Anchors, measured in the same process when importable from a local copy under
`.anchors/` (gitignored; copied from github.com/state-spaces/mamba, commit in
.anchors/MAMBA_COMMIT): prefill `selective_scan_fn` (the CUDA kernel; it needs the
compiled `selective_scan_cuda` extension, else `selective_scan_ref`, mamba_ssm's torch
reference, a Python loop over time, is timed and labelled so); decode the Triton
`selective_state_update`.

Figures: kernel time (GPU: a jax.profiler trace for ours, CUDA events for torch; CPU:
wall time), and for decode the bytes moved (state read + written, inputs and output)
against the copy bandwidth measured in the same process. Outputs of ours and the
anchors are compared (max relative difference) on the same inputs.

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 PYTHONPATH=.:.anchors python benchmarks/mamba1.py \
        --out bench_out/mamba1.json                                # GPU (torch gets the rest)
    ... benchmarks/mamba1.py --sweep        # also the prefill kernel's block / tile / warps
    PYTHONPATH=.:.anchors python benchmarks/mamba1.py --smoke      # CPU: tiny shapes, interpret
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import selective_scan as ss
from pallas_kernels.selective_scan import selective_scan_ragged, selective_scan_step

FALCON_MAMBA_7B = dict(c=8192, n=16)
SMOKE = dict(c=128, n=16)


def _time_us(fn, reps: int) -> float:
    """us per call of a JAX function: GPU kernel time from a trace, else wall time."""
    jax.block_until_ready(fn())
    if jax.default_backend() == "gpu":
        from serving.entrypoints.bench.trace_report import gpu_kernel_events

        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d):
                for _ in range(reps):
                    jax.block_until_ready(fn())
            evs = [ev for _, ev in gpu_kernel_events(d)]
        return sum(e.duration_ns for e in evs) * 1e-3 / reps
    t = time.perf_counter()
    for _ in range(reps):
        jax.block_until_ready(fn())
    return (time.perf_counter() - t) * 1e6 / reps


def _torch_us(fn, reps: int) -> float:
    import torch

    if not torch.cuda.is_available():  # the smoke run: wall time on the CPU
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) * 1e6 / reps
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def _inputs(rng, t: int, c: int, n: int):
    bf = jnp.bfloat16
    x, dt, z = (jnp.asarray(rng.standard_normal((t, c)), bf) for _ in range(3))
    dt = (dt * 0.5 - 2.0).astype(bf)
    B, C = (jnp.asarray(rng.standard_normal((t, n)), bf) for _ in range(2))
    A = -jnp.exp(jnp.asarray(rng.uniform(-1, 1.5, (c, n)), jnp.float32))
    D = jnp.asarray(rng.standard_normal(c), jnp.float32)
    bias = jnp.asarray(rng.normal(-1, 0.5, c), jnp.float32)
    return x, dt, z, B, C, A, D, bias


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _torch_device(smoke: bool) -> str | None:
    """Where the torch anchors run: the GPU, the CPU in a smoke run (prefill only), or None."""
    try:
        import torch
    except ImportError:
        return None
    return "cuda" if torch.cuda.is_available() else ("cpu" if smoke else None)


def bench_prefill(args, c: int, n: int, impl: str) -> dict:
    seqs, length = args.seqs, args.length
    t = seqs * length
    x, dt, z, B, C, A, D, bias = _inputs(np.random.default_rng(0), t, c, n)
    cu = jnp.arange(seqs + 1, dtype=jnp.int32) * length
    slots = jnp.arange(1, seqs + 1, dtype=jnp.int32)
    init = jnp.zeros((seqs,), bool)
    states = jnp.zeros((seqs + 1, c, n), jnp.float32)
    out = {"shape": f"{seqs} x {length}, c {c}, n {n}"}
    kernels = {"pallas": impl} | ({"reference": "reference"} if args.reference else {})
    ys = {}
    for name, which in kernels.items():
        f = jax.jit(lambda x, dt, z, B, C, s, which=which: selective_scan_ragged(
            x, dt, A, B, C, D, bias, cu, s, slots, init, z=z, impl=which))
        ys[name] = f(x, dt, z, B, C, states)[0]
        out[f"{name}_us"] = _time_us(lambda f=f: f(x, dt, z, B, C, states), args.reps)
        out[f"{name}_mtok_s"] = t / out[f"{name}_us"]
    if "reference" in ys:
        out["pallas_vs_reference"] = _rel(ys["pallas"], ys["reference"])
    if args.sweep:  # launch knobs of the prefill kernel (defaults: block 128, tile 16, 4 warps)
        out["sweep"] = []
        ids = (cu, slots, init.astype(jnp.int32))
        want = np.asarray(ys["pallas"].astype(jnp.float32))
        for block_c in (32, 64, 128, 256):
            for tile in (8, 16):
                for warps in (1, 2, 4, 8):
                    def call(block_c=block_c, tile=tile, warps=warps):
                        return ss._ragged_pallas(x, dt, A, B, C, D, bias, z, ids[0], states, ids[1], ids[2],
                                                 impl=impl, tile=tile if impl == "pallas" else 4,
                                                 block_c=block_c, warps=warps)
                    row = {"block_c": block_c, "tile": tile, "warps": warps}
                    try:
                        row["rel_vs_default"] = _rel(call()[0].astype(jnp.float32), want)
                        row["us"] = _time_us(call, max(2, args.reps // 4))
                    except Exception as err:  # a launch that fails to compile is a figure too
                        row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
                    out["sweep"].append(row)
                    print(json.dumps(row), flush=True)
    if (device := _torch_device(args.smoke)) is not None:
        out |= _prefill_anchor(args, device, x, dt, z, B, C, A, D, bias, ys["pallas"])
    return out


def _prefill_anchor(args, device, x, dt, z, B, C, A, D, bias, ours) -> dict:
    import torch

    try:
        from mamba_ssm.ops import selective_scan_interface as ssi
    except ImportError as e:
        return {"anchor": f"not importable: {e}"}
    tt = lambda a: torch.from_numpy(np.array(a.astype(jnp.float32))).to(device)  # noqa: E731
    seqs, length = args.seqs, args.length
    c = x.shape[1]
    # mamba_ssm layout: u, delta, z [b, c, l]; B, C [b, n, l] (one group); A [c, n].
    lay = lambda a: tt(a).reshape(seqs, length, -1).transpose(1, 2).contiguous()  # noqa: E731
    u, delta, zz = (lay(a).to(torch.bfloat16) for a in (x, dt, z))
    Bt, Ct = (lay(a).to(torch.bfloat16) for a in (B, C))
    At, Dt, bt = tt(A), tt(D), tt(bias)
    if ssi.selective_scan_cuda is not None and device == "cuda":
        name, fn = "selective_scan_fn (CUDA)", ssi.selective_scan_fn
    else:
        name, fn = "selective_scan_ref (torch loop; selective_scan_cuda not built)", ssi.selective_scan_ref

    def run():
        return fn(u, delta, At, Bt, Ct, Dt, z=zz, delta_bias=bt, delta_softplus=True)

    y = run()
    us = _torch_us(run, max(1, args.reps // 5))
    theirs = y.float().transpose(1, 2).reshape(seqs * length, c).cpu().numpy()
    return {"anchor": name, "anchor_us": us, "anchor_mtok_s": seqs * length / us,
            "pallas_vs_anchor": _rel(np.asarray(ours.astype(jnp.float32)), theirs)}


def _copy_bandwidth() -> float:
    if jax.default_backend() != "gpu":
        return float("nan")
    from serving.entrypoints.bench.floor import copy_bandwidth

    return copy_bandwidth()


def bench_decode(args, c: int, n: int, impl: str, batch: int, state_dtype, bandwidth: float) -> dict:
    x, dt, z, B, C, A, D, bias = _inputs(np.random.default_rng(1), batch, c, n)
    slots = jnp.arange(1, batch + 1, dtype=jnp.int32)
    states = jnp.asarray(np.random.default_rng(2).standard_normal((batch + 1, c, n)), state_dtype)
    q = lambda a: a[:, None]  # noqa: E731
    st_bytes = jnp.dtype(state_dtype).itemsize
    moved = 2 * batch * c * n * st_bytes + batch * (4 * c + 2 * n) * 2
    out = {"shape": f"B {batch}, c {c}, n {n}, state {jnp.dtype(state_dtype).name}", "bytes": moved}
    kernels = {"pallas": impl} | ({"reference": "reference"} if args.reference else {})
    ys = {}
    for name, which in kernels.items():
        f = jax.jit(lambda s, which=which: selective_scan_step(
            q(x), q(dt), A, q(B), q(C), D, bias, s, slots, z=q(z), impl=which), donate_argnums=0)
        st = jnp.copy(states)
        y, st = f(st)
        ys[name] = y

        def call(f=f):
            nonlocal st
            y, st = f(st)
            return y

        out[f"{name}_us"] = _time_us(call, args.reps)
        out[f"{name}_tb_s"] = moved / out[f"{name}_us"] * 1e-6
        out[f"{name}_of_copy"] = moved / (out[f"{name}_us"] * 1e-6) / bandwidth
    if "reference" in ys:
        out["pallas_vs_reference"] = _rel(*(ys[k].astype(jnp.float32) for k in ("pallas", "reference")))
    if _torch_device(False) is not None:
        out |= _decode_anchor(args, x, dt, z, B, C, A, D, bias, states, ys["pallas"], moved, bandwidth)
    return out


def _decode_anchor(args, x, dt, z, B, C, A, D, bias, states, ours, moved, bandwidth) -> dict:
    import torch

    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
    except ImportError as e:
        return {"anchor": f"not importable: {e}"}
    tt = lambda a: torch.from_numpy(np.array(a.astype(jnp.float32))).cuda()  # noqa: E731
    sdt = torch.float32 if states.dtype == jnp.float32 else torch.bfloat16
    st = tt(states[1:]).to(sdt).contiguous()  # [b, c, n]
    xs, dts, zs = (tt(a).to(torch.bfloat16) for a in (x, dt, z))
    Bs, Cs = (tt(a).to(torch.bfloat16) for a in (B, C))
    At, Dt, bt = tt(A), tt(D), tt(bias)

    def run():
        return selective_state_update(st, xs, dts, At, Bs, Cs, D=Dt, z=zs, dt_bias=bt, dt_softplus=True)

    y = run()
    us = _torch_us(run, args.reps)
    first = np.asarray(ours.astype(jnp.float32))[:, 0]  # both from the same initial states
    return {"anchor": "mamba_ssm selective_state_update (Triton)", "anchor_us": us,
            "anchor_of_copy": moved / (us * 1e-6) / bandwidth,
            "pallas_vs_anchor": _rel(first, y.float().cpu().numpy())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, default=4)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--reference", action="store_true", help="also time the pure-JAX references")
    p.add_argument("--sweep", action="store_true", help="time the prefill kernel's launch knobs")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    shape, impl = FALCON_MAMBA_7B, "pallas"
    if args.smoke:
        shape, impl = SMOKE, "interpret"
        args.seqs, args.length, args.batches, args.reps, args.reference = 2, 24, [4], 2, True
    bandwidth = _copy_bandwidth()
    report = {"device": str(jax.devices()[0]), "copy_bandwidth_tb_s": bandwidth * 1e-12,
              "prefill": bench_prefill(args, **shape, impl=impl), "decode": []}
    print(json.dumps(report["prefill"]), flush=True)
    for batch in args.batches:
        for sd in (jnp.float32, jnp.bfloat16):
            row = bench_decode(args, **shape, impl=impl, batch=batch, state_dtype=sd, bandwidth=bandwidth)
            report["decode"].append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
