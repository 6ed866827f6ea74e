"""Test session settings: one persistent XLA compilation cache for the whole run.

Engines with the same model and shapes in different test modules then compile once.
"""

from __future__ import annotations

import tempfile

import jax

if jax.config.jax_compilation_cache_dir is None:
    jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="hybrid-jax-xla-"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
