"""Where the milliseconds of the traced steps go, read back from a jax.profiler trace.

Reads the Chrome-format trace (`*.trace.json.gz`) that `jax.profiler` writes and
reports, per named host scope (engine_step, schedule, host_prep, device_step,
update), the count and mean duration, and, per device lane (a GPU stream, or XLA's
module and op lanes), the busy time per traced engine step. On a GPU the stream lanes'
busy time per step is the kernel time a step costs; engine_step minus that is the
time the device waits for the host or between kernels.

The benchmarks in `benchmarks/` read the binary xplane trace through jax.profiler's
ProfileData instead: `trace_calls` records one around n calls of a function,
`gpu_kernel_events` yields its GPU kernels, `kernel_totals` sums them by name and
`host_event_totals` sums the host's TraceMe scopes.
"""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from pathlib import Path


def kernel_family(name: str) -> str:
    """A kernel's family: its name without XLA's numeric suffixes (fusion.12 -> fusion)."""
    return name.rstrip("0123456789").rstrip("_.") or name


def summarize(directory: str | Path, scopes: list[str]) -> dict:
    """Per-scope count and mean ms; per device lane busy ms per engine step. {} if no trace."""
    files = sorted(Path(directory).rglob("*.trace.json.gz"))
    if not files:
        return {}
    events = json.loads(gzip.decompress(files[-1].read_bytes()))["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    scope_us: dict[str, list[float]] = defaultdict(list)
    lane_us: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("ph") != "X":
            continue
        if e["name"] in scopes:
            scope_us[e["name"]].append(float(e.get("dur", 0.0)))
        proc = procs.get(e["pid"], "")
        if proc.startswith("/device:"):
            lane_us[f"{proc} {threads.get((e['pid'], e['tid']), e['tid'])}"] += float(e.get("dur", 0.0))
    steps = max(1, len(scope_us.get("engine_step", [])))
    return {
        "file": str(files[-1]), "steps": steps,
        "scope_stats": {k: {"count": len(v), "mean_ms": sum(v) / len(v) / 1e3} for k, v in scope_us.items()},
        "device_lanes_ms_per_step": {k: v / steps / 1e3 for k, v in sorted(lane_us.items())},
    }


def gpu_kernel_events(directory: str | Path, memcpy: bool = False):
    """(device plane name, event) for every GPU kernel of the newest xplane trace under
    `directory` (stream lines only; memcpys only if `memcpy`), as jax.profiler.ProfileData
    reads it."""
    import os

    from jax.profiler import ProfileData

    path = next(os.path.join(r, f) for r, _, fs in os.walk(directory) for f in fs
                if f.endswith(".xplane.pb"))
    for plane in ProfileData.from_file(path).planes:
        if "GPU" not in plane.name:
            continue
        for line in plane.lines:
            low = line.name.lower()
            if "stream" not in low or "#" not in low:
                continue
            for ev in line.events:
                if memcpy or "memcpy" not in ev.name.lower():
                    yield plane.name, ev


def host_event_totals(directory: str | Path, steps: int, top: int = 30) -> list[list]:
    """Host-side trace events (TraceMe scopes: JAX dispatch, PJRT execute, command-buffer
    update and submit, ...) of the newest xplane trace under `directory`: per (thread,
    name) the ms per step and calls per step, largest first. Nested scopes each count."""
    import os

    from jax.profiler import ProfileData

    path = next(os.path.join(r, f) for r, _, fs in os.walk(directory) for f in fs
                if f.endswith(".xplane.pb"))
    totals: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for plane in ProfileData.from_file(path).planes:
        if "host" not in plane.name.lower():
            continue
        for line in plane.lines:
            for ev in line.events:
                t = totals[(line.name[:40], ev.name[:90])]
                t[0] += ev.duration_ns
                t[1] += 1
    rows = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return [[thread, name, round(ns / 1e6 / steps, 4), round(n / steps, 2)]
            for (thread, name), (ns, n) in rows]


def kernel_totals(directory: str, steps: int, top: int = 25) -> list[tuple[str, float, int]]:
    """(kernel, ms per step, launches per step) of a trace, by time: where a prefill step goes;
    first "total", then "gpu_span" (first kernel's start to the last one's end, ms per step)."""
    by_name: dict[str, list[float]] = defaultdict(list)
    lo, hi = float("inf"), float("-inf")
    for _, ev in gpu_kernel_events(directory):
        by_name[ev.name[:80]].append(ev.duration_ns)
        lo, hi = min(lo, ev.start_ns), max(hi, ev.end_ns)
    rows = sorted(((k, sum(v) / 1e6 / steps, len(v) // steps) for k, v in by_name.items()),
                  key=lambda r: -r[1])
    return [("total", sum(r[1] for r in rows), sum(r[2] for r in rows)),
            ("gpu_span", (hi - lo) / 1e6 / steps, 0), *rows[:top]]


def trace_calls(fn, n: int) -> str:
    """Call fn() n times under jax.profiler (waiting for the last result); the trace's
    directory, for gpu_kernel_events and the summaries above."""
    import tempfile

    import jax

    directory = tempfile.mkdtemp()
    jax.profiler.start_trace(directory)
    out = None
    for _ in range(n):
        out = fn()
    jax.block_until_ready(out)
    jax.profiler.stop_trace()
    return directory
