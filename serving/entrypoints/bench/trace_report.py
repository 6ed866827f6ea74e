"""Where the milliseconds of the traced steps go, read back from a jax.profiler trace.

Reads the Chrome-format trace (`*.trace.json.gz`) that `jax.profiler` writes and
reports, per named host scope (engine_step, schedule, host_prep, device_step,
update), the count and mean duration, and, per device lane (a GPU stream, or XLA's
module and op lanes), the busy time per traced engine step. On a GPU the stream lanes'
busy time per step is the kernel time a step costs; engine_step minus that is the
time the device waits for the host or between kernels.
"""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from pathlib import Path


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
