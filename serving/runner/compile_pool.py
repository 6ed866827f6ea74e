"""Start-up compilation of a set of executables: loaded from the executable store where
it holds them, else lowered (serial: Python) and compiled on a thread pool.

Each compilation starts as soon as its lowering is done: XLA compiles without the GIL,
beside the lowering of the next ones. Deserialising from the store runs on a thread pool
too (XLA loads without the GIL). Jobs that `defer` names and the store does not hold are
left out and handed back, for the caller to build later (`compile_later`). This module
knows nothing of what the executables compute: serving/runner/executables.py says
which to build, for `ModelRunner.compile_all` (serving/runner/runner.py).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed

# One job: (key, a function of nothing that lowers it, its store key or None, the
# arguments the executable will be called with: a stored one must take them).
Job = tuple[object, Callable[[], object], str | None, tuple]


def compile_jobs(todo: list[Job], *, opts: dict | None, store, done: Callable[[object, object], None],
                 workers: int | None = None, defer: Callable[[object], bool] | None = None,
                 deferred: list[Job] | None = None) -> dict[str, float]:
    """Build every job, calling `done(key, executable)` as each is ready. Returns the
    seconds spent loading (`load_s`), lowering (`lower_s`) and waiting for compilations
    after the last lowering (`compile_s`), and the counts `executables` and `loaded`.

    A job whose key `defer` accepts and that the store does not hold is appended to
    `deferred` instead of being built (counted in `deferred`, not in `executables`)."""
    timing = {"load_s": 0.0, "lower_s": 0.0, "compile_s": 0.0}
    t0 = time.perf_counter()
    jobs = []
    if store is not None:
        with ThreadPoolExecutor(workers or max(1, min(len(todo), os.cpu_count() or 2))) as pool:
            loaded = list(pool.map(lambda job: store.load(job[2], job[3]), todo))
    else:
        loaded = [None] * len(todo)
    later = 0
    for job, exe in zip(todo, loaded, strict=True):
        key, lower, skey, _ = job
        if exe is not None:
            done(key, exe)
        elif defer is not None and defer(key):
            deferred.append(job)
            later += 1
        else:
            jobs.append((key, lower, skey))
    timing["load_s"] = time.perf_counter() - t0
    if jobs:
        futures: dict = {}

        def collect(fut) -> None:
            key, skey = futures.pop(fut)
            exe = fut.result()
            if store is not None:
                store.save(skey, exe)
            done(key, exe)

        with ThreadPoolExecutor(workers or min(len(jobs), max(1, (os.cpu_count() or 2)))) as pool:
            for key, lower, skey in jobs:
                t0 = time.perf_counter()
                low = lower()
                timing["lower_s"] += time.perf_counter() - t0
                futures[pool.submit(low.compile, compiler_options=opts)] = (key, skey)
                for fut in [f for f in futures if f.done()]:
                    collect(fut)
            t0 = time.perf_counter()
            for fut in as_completed(list(futures)):
                collect(fut)
            timing["compile_s"] = time.perf_counter() - t0
        if store is not None:
            store.prune()
    return {**timing, "executables": len(todo) - later, "loaded": len(todo) - len(jobs) - later,
            "deferred": later}


def compile_later(jobs: list[Job], *, opts: dict | None, store,
                  done: Callable[[dict | Exception], None]) -> threading.Thread:
    """Build `jobs` on a daemon thread (its lowering takes the GIL in turns with the
    caller's thread; XLA compiles without it) and store them, then call `done` from that
    thread with {key: executable} for all of them, or with the exception if one failed."""
    def run() -> None:
        built: dict = {}
        try:
            compile_jobs(jobs, opts=opts, store=None, done=built.__setitem__, workers=2)
            if store is not None:
                for key, _, skey, _ in jobs:
                    store.save(skey, built[key])
        except Exception as e:  # noqa: BLE001 - handed to the engine, which logs it
            done(e)
            return
        done(built)

    t = threading.Thread(target=run, name="hybrid-jax-compile-later", daemon=True)
    t.start()
    return t
