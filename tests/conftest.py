"""Test session settings: one persistent XLA compilation cache for the whole run.

Engines with the same model and shapes in different test modules then compile once.
The cache is this run's own temporary directory, removed when the run ends (each run
left hundreds of MB of /tmp/hybrid-jax-xla-* behind).
"""

from __future__ import annotations

import shutil
import tempfile

import jax

_CACHE_DIR: str | None = None
if jax.config.jax_compilation_cache_dir is None:
    _CACHE_DIR = tempfile.mkdtemp(prefix="hybrid-jax-xla-")
    jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def pytest_sessionfinish(session, exitstatus) -> None:
    if _CACHE_DIR is not None:
        shutil.rmtree(_CACHE_DIR, ignore_errors=True)
