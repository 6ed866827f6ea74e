"""Test session settings: one persistent XLA compilation cache for the whole run (both
xdist workers share it).

Engines with the same model and shapes in different test modules then compile once.
The cache is this run's own temporary directory, removed when the run ends (each run
left hundreds of MB of /tmp/hybrid-jax-xla-* behind).

XLA's CPU backend compiles at LLVM optimisation level 0 in tests: the suite's time is
mostly compilation of tiny-shape executables (engines' buckets, interpret-mode kernels),
and -O0 takes ~20% off it (an engine-heavy module 103 -> 79 s, the training modules
149 -> 132 s, measured side by side on the 2-core machine). The HLO passes are the same,
and IEEE semantics hold at every level (no fast math), so what the tests compare is
unchanged; child processes inherit the flag (they append their own XLA_FLAGS).
"""

from __future__ import annotations

import os
import shutil
import tempfile

_OPT = "--xla_backend_optimization_level"
if _OPT not in os.environ.get("XLA_FLAGS", ""):  # before JAX starts a backend
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_OPT}=0".strip()

import jax  # noqa: E402

# pytest-xdist workers inherit the controller's environment: the controller (or a run
# without xdist) creates the directory and names it in this variable, so both workers
# read and write one cache (an engine compiled in one worker's module is a cache hit in
# the other's) and only its creator removes it. JAX reads a damaged entry as a miss.
_ENV = "PYTEST_HYBRID_JAX_XLA_CACHE"  # not a HYBRID_JAX_ switch: no store key
_CACHE_DIR: str | None = None
if jax.config.jax_compilation_cache_dir is None:
    shared = os.environ.get(_ENV)
    if shared is None:
        shared = _CACHE_DIR = tempfile.mkdtemp(prefix="hybrid-jax-xla-")
        os.environ[_ENV] = shared
    jax.config.update("jax_compilation_cache_dir", shared)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def pytest_sessionfinish(session, exitstatus) -> None:
    if _CACHE_DIR is not None and not hasattr(session.config, "workerinput"):
        shutil.rmtree(_CACHE_DIR, ignore_errors=True)
