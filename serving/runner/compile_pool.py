"""Start-up compilation of a set of executables: loaded from the executable store where
it holds them, else lowered (serial: Python) and compiled on a thread pool.

Each compilation starts as soon as its lowering is done: XLA compiles without the GIL,
beside the lowering of the next ones. Deserialising from the store runs on a thread pool
too (XLA loads without the GIL). This module knows nothing of what the executables
compute: `ModelRunner.compile_all` (serving/runner/runner.py) says which to build.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed

# One job: (key, a function of nothing that lowers it, its store key or None, the
# arguments the executable will be called with: a stored one must take them).
Job = tuple[object, Callable[[], object], str | None, tuple]


def compile_jobs(todo: list[Job], *, opts: dict | None, store, done: Callable[[object, object], None],
                 workers: int | None = None) -> dict[str, float]:
    """Build every job, calling `done(key, executable)` as each is ready. Returns the
    seconds spent loading (`load_s`), lowering (`lower_s`) and waiting for compilations
    after the last lowering (`compile_s`), and the counts `executables` and `loaded`."""
    timing = {"load_s": 0.0, "lower_s": 0.0, "compile_s": 0.0}
    t0 = time.perf_counter()
    jobs = []
    if store is not None:
        with ThreadPoolExecutor(workers or max(1, min(len(todo), os.cpu_count() or 2))) as pool:
            loaded = list(pool.map(lambda job: store.load(job[2], job[3]), todo))
    else:
        loaded = [None] * len(todo)
    for (key, lower, skey, _), exe in zip(todo, loaded, strict=True):
        if exe is not None:
            done(key, exe)
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
    return {**timing, "executables": len(todo), "loaded": len(todo) - len(jobs)}
