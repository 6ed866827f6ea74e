"""Compiled step executables kept on disk and loaded without tracing (warm start-up).

JAX's persistent compilation cache keys an executable on its lowered HLO, so even a
warm start traces and lowers every step executable first: seconds each for a
24-layer model, most of a warm start-up. This store keys an executable on what
determines it instead, computed without tracing:

- this package's source (every .py file of hybrid_jax/, pallas_kernels/, serving/),
  jax, jaxlib and flax versions, the backend's platform version, the devices it runs
  on, the jax settings that change tracing (x64, matmul precision, PRNG), XLA_FLAGS and
  the HYBRID_JAX_* environment variables (except secrets, debug and this store's switch);
- the model configuration and dtype (with the source, they fix the traced graph);
- the job: which executable (forward, verify, sampler), its bucket and flags, the
  static layouts it closes over, the compile options, and the shape, dtype and
  sharding of every argument.

A hit deserializes the executable (`jax.experimental.serialize_executable`); a miss
lowers and compiles it as before and writes it. Anything unexpected (a backend that
cannot serialize, a corrupt or foreign file) falls back to lowering and compiling:
the store can make start-up faster, never wrong. Files are written atomically
(temporary file, then rename), so concurrent engines sharing a directory are safe.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import tempfile
import threading
from pathlib import Path

import jax

from configs import switches

log = logging.getLogger(__name__)
_PACKAGES = ("hybrid_jax", "pallas_kernels", "serving")
VERSION = 1  # bump to orphan every stored executable
DEFAULT_MAX_BYTES = 8 << 30  # HYBRID_JAX_EXECUTABLE_STORE_MAX_GB overrides


@functools.cache
def source_digest() -> str:
    """SHA-256 over this project's Python sources (paths and contents)."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for pkg in _PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


# jax settings that change what a function traces or lowers to.
_JAX_FLAGS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_threefry_partitionable",
              "jax_default_prng_impl", "jax_numpy_dtype_promotion")


def _environment(devices) -> str:
    import flax
    import jaxlib

    backend = jax.devices()[0].client
    xla_flags = [(k, v) for k, v in os.environ.items() if k == "XLA_FLAGS"]
    env = sorted([*switches.keyed_environment(), *xla_flags])
    flags = [(f, str(getattr(jax.config, f, None))) for f in _JAX_FLAGS]
    return repr((VERSION, source_digest(), jax.__version__, jaxlib.__version__, flax.__version__,
                 backend.platform, backend.platform_version,
                 [(d.id, d.platform, getattr(d, "device_kind", "")) for d in devices], flags, env))


def describe_args(args) -> str:
    """Shape, dtype, weak type and sharding of every leaf of `args`, with the tree structure."""
    leaves, treedef = jax.tree.flatten(args)

    def one(x) -> tuple:
        sharding = getattr(x, "sharding", None)
        return (tuple(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False)),
                repr(sharding) if sharding is not None else None)

    return repr((str(treedef), [one(x) for x in leaves]))


class ExecutableStore:
    """A directory of serialized executables, one file per key."""

    def __init__(self, directory: str | os.PathLike, devices, max_bytes: int | None = None) -> None:
        self.dir = Path(directory)
        if max_bytes is None:
            max_bytes = switches.executable_store_max_bytes(DEFAULT_MAX_BYTES)
        self.max_bytes = max_bytes
        self.context = _environment(devices)
        self.hits = self.misses = self.errors = 0
        self._lock = threading.Lock()  # loads run on a thread pool

    def key(self, *parts: object) -> str:
        return hashlib.sha256(repr((self.context, parts)).encode()).hexdigest()

    def load(self, key: str):
        """The stored executable for `key`, or None (absent, unreadable, or not loadable here)."""
        path = self.dir / f"{key}.exe"
        if not path.exists():
            with self._lock:
                self.misses += 1
            return None
        try:
            from jax.experimental.serialize_executable import deserialize_and_load

            payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            out = deserialize_and_load(payload, in_tree, out_tree)
            os.utime(path)  # recently used: the last to be pruned
        except Exception as err:  # a foreign or damaged file: compile instead
            log.warning("stored executable %s not loaded (%s: %s); compiling", path.name,
                        type(err).__name__, err)
            with self._lock:
                self.errors += 1
            return None
        with self._lock:
            self.hits += 1
        return out

    def save(self, key: str, compiled) -> None:
        """Write `compiled` under `key` (atomically); failures only log."""
        try:
            from jax.experimental.serialize_executable import serialize

            data = pickle.dumps(serialize(compiled))
            self.dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self.dir / f"{key}.exe")
        except Exception as err:
            self.errors += 1
            log.warning("executable not stored (%s: %s)", type(err).__name__, err)

    def prune(self) -> int:
        """Delete the least recently used executables until the store holds at most
        `max_bytes` (every code change makes new keys: old files would pile up).
        Returns the number deleted; failures (a file another process removed) are skipped."""
        files = []
        for f in self.dir.glob("*.exe"):
            try:
                st = f.stat()
            except OSError:
                continue
            files.append((st.st_mtime, st.st_size, f))
        total = sum(size for _, size, _ in files)
        deleted = 0
        for _, size, f in sorted(files, key=lambda x: x[0]):
            if total <= self.max_bytes:
                break
            try:
                f.unlink()
            except OSError:
                continue
            total -= size
            deleted += 1
        return deleted


def default_store(devices) -> ExecutableStore | None:
    """The store beside JAX's persistent compilation cache, if one is configured
    (EngineConfig.compilation_cache_dir), on GPU, at most HYBRID_JAX_EXECUTABLE_STORE_MAX_GB
    (default 8) on disk, least recently used executables pruned first; HYBRID_JAX_EXECUTABLE_STORE=0 turns it
    off, =1 on for any backend. Off by default on CPU: jaxlib 0.10's CPU executables
    can deserialize without some of their fused functions ("NOT_FOUND: Function ...
    not found" at the first call), and CPU start-up is not what the store is for."""
    base = jax.config.jax_compilation_cache_dir
    switch = switches.executable_store()
    if not base or switch == "0" or (switch != "1" and jax.default_backend() != "gpu"):
        return None
    return ExecutableStore(Path(os.path.expanduser(base)) / "hybrid-jax-executables", devices)
