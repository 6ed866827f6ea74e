"""Compiled step executables kept on disk and loaded without tracing (warm start-up).

JAX's persistent compilation cache keys an executable on its lowered HLO, so even a
warm start traces and lowers every step executable first: seconds each for a
24-layer model, most of a warm start-up. This store keys an executable on what
determines it instead, computed without tracing:

- this package's source (every .py file of hybrid_jax/, pallas_kernels/, serving/),
  jax, jaxlib and flax versions, the backend's platform version, the devices it runs
  on (ids in mesh order, platform, kind, count), the jax settings that change tracing
  (x64, matmul precision, PRNG), XLA_FLAGS and the HYBRID_JAX_* environment variables
  (except secrets, debug and this store's switch);
- the model configuration and dtype (with the source, they fix the traced graph) and
  the engine configuration;
- the job: which executable (forward, verify, sampler), its bucket and flags, the
  static layouts it closes over, the compile options, and the shape, dtype and
  sharding of every argument.

A hit deserializes the executable (`jax.experimental.serialize_executable`) onto exactly
the engine's devices, then checks it (`mismatch`): its device assignment must be the
engine's, its input and output shardings those recorded when it was compiled, and its
input shardings those of the arguments the engine passes; otherwise it is a miss. A
miss lowers and compiles as before and writes the executable with its signature.
Anything unexpected (a backend that cannot serialize, a corrupt or foreign file) falls
back to lowering and compiling: the store can make start-up faster, never wrong. Files are written atomically
(temporary file, then rename), so concurrent engines sharing a directory are safe.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
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
VERSION = 2  # bump to orphan every stored executable
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


def _device_desc(devices) -> list[tuple]:
    return [(d.id, d.platform, getattr(d, "device_kind", ""), d.process_index) for d in devices]


def _environment(devices) -> str:
    import flax
    import jaxlib

    backend = devices[0].client
    xla_flags = [(k, v) for k, v in os.environ.items() if k == "XLA_FLAGS"]
    env = sorted([*switches.keyed_environment(), *xla_flags])
    flags = [(f, str(getattr(jax.config, f, None))) for f in _JAX_FLAGS]
    return repr((VERSION, source_digest(), jax.__version__, jaxlib.__version__, flax.__version__,
                 backend.platform, backend.platform_version, len(devices), _device_desc(devices),
                 flags, env))


def _sharding_devices(sharding) -> tuple[int, ...]:
    """Device ids of a sharding in its assignment order (the order its shards take)."""
    order = getattr(sharding, "_device_assignment", None)  # private in jax 0.10 and 0.11
    if order is None:
        order = sorted(sharding.device_set, key=lambda d: d.id)
    return tuple(d.id for d in order)


def describe_sharding(sharding) -> tuple | None:
    """A sharding as plain data, device ids included (a NamedSharding's repr names its
    mesh's shape, not which devices it holds)."""
    if sharding is None:
        return None
    mesh = getattr(sharding, "mesh", None)
    axes = tuple(getattr(mesh, "shape", {}).items()) if mesh is not None else None
    return (type(sharding).__name__, _sharding_devices(sharding), axes,
            str(getattr(sharding, "spec", "")), getattr(sharding, "memory_kind", None))


def describe_args(args) -> str:
    """Shape, dtype, weak type and sharding of every leaf of `args`, with the tree structure."""
    leaves, treedef = jax.tree.flatten(args)

    def one(x) -> tuple:
        return (tuple(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False)),
                describe_sharding(getattr(x, "sharding", None)))

    return repr((str(treedef), [one(x) for x in leaves]))


def _executable_devices(compiled) -> tuple[int, ...]:
    """Ids of the devices a compiled executable runs on (its device assignment). Private
    attributes (jax 0.10 and 0.11): a jax without them raises, and the store misses."""
    return tuple(d.id for d in compiled._executable.xla_executable.local_devices())


def signature(compiled) -> tuple:
    """What a compiled executable expects and produces: its devices and the sharding
    of every input and output, as plain data (recorded beside a stored executable)."""
    ins = jax.tree.leaves(compiled.input_shardings)
    outs = jax.tree.leaves(compiled.output_shardings)
    return (_executable_devices(compiled), tuple(describe_sharding(s) for s in ins),
            tuple(describe_sharding(s) for s in outs))


def _deserialize(payload, in_tree, out_tree, devices):
    """`deserialize_and_load` onto exactly `devices`. Without `execution_devices`
    jax loads onto every device of the backend, and an executable of one device then
    expects one shard per local device at its first call."""
    from jax.experimental.serialize_executable import deserialize_and_load

    params = inspect.signature(deserialize_and_load).parameters
    if "execution_devices" not in params:  # an API this module does not know: no guessing
        raise RuntimeError("jax's deserialize_and_load takes no execution_devices")
    return deserialize_and_load(payload, in_tree, out_tree, backend=devices[0].client,
                                execution_devices=list(devices))


def mismatch(compiled, recorded: tuple, args, devices) -> str | None:
    """Why a deserialized executable must not serve an engine on `devices` that passes
    `args` (None: it may). Checks its device assignment against the engine's devices,
    its signature against the one recorded when it was compiled, and its input shardings
    against the shardings of the arguments the engine will pass."""
    want = tuple(d.id for d in devices)
    got = signature(compiled)
    if got[0] != want:
        return f"runs on devices {list(got[0])}, the engine on {list(want)}"
    if got != recorded:
        return "its shardings differ from those it was compiled with"
    if args is None:
        return None
    leaves, treedef = jax.tree.flatten(tuple(args))
    try:
        ins = treedef.flatten_up_to(compiled.input_shardings[0])
    except (ValueError, TypeError):
        return "its arguments are not the ones the engine passes"
    for i, (s, x) in enumerate(zip(ins, leaves, strict=True)):
        passed = getattr(x, "sharding", None)
        if s is None:  # an argument the executable does not take (pruned): nothing to place
            continue
        if not set(_sharding_devices(s)) <= set(want):
            return f"argument {i} lives on devices outside the engine's"
        if passed is not None and not (_sharding_devices(s) == _sharding_devices(passed)
                                       and s.is_equivalent_to(passed, len(x.shape))):
            return f"argument {i} is sharded {s}, the engine passes {passed}"
    return None


class ExecutableStore:
    """A directory of serialized executables, one file per key, for one set of devices
    (the engine's mesh, in order): every executable is loaded onto exactly them."""

    def __init__(self, directory: str | os.PathLike, devices, max_bytes: int | None = None) -> None:
        self.dir = Path(directory)
        if max_bytes is None:
            max_bytes = switches.executable_store_max_bytes(DEFAULT_MAX_BYTES)
        self.max_bytes = max_bytes
        self.devices = tuple(devices)
        self.context = _environment(self.devices)
        self.hits = self.misses = self.errors = self.rejected = 0
        self._lock = threading.Lock()  # loads run on a thread pool

    def key(self, *parts: object) -> str:
        return hashlib.sha256(repr((self.context, parts)).encode()).hexdigest()

    def _count(self, what: str) -> None:
        with self._lock:
            setattr(self, what, getattr(self, what) + 1)

    def load(self, key: str, args=None):
        """The stored executable for `key`, or None (absent, unreadable, not loadable here,
        or not one that may take `args` on this store's devices: see `mismatch`)."""
        path = self.dir / f"{key}.exe"
        if not path.exists():
            self._count("misses")
            return None
        try:
            payload, in_tree, out_tree, recorded = pickle.loads(path.read_bytes())
            out = _deserialize(payload, in_tree, out_tree, self.devices)
            why = mismatch(out, recorded, args, self.devices)
        except Exception as err:  # a foreign or damaged file: compile instead
            log.warning("stored executable %s not loaded (%s: %s); compiling", path.name,
                        type(err).__name__, err)
            self._count("errors")
            return None
        if why is not None:  # a valid executable, but not for this engine
            log.warning("stored executable %s does not fit this engine (%s); compiling", path.name, why)
            self._count("rejected")
            return None
        os.utime(path)  # recently used: the last to be pruned
        self._count("hits")
        return out

    def save(self, key: str, compiled) -> None:
        """Write `compiled` and its signature under `key` (atomically); failures only log."""
        try:
            from jax.experimental.serialize_executable import serialize

            data = pickle.dumps((*serialize(compiled), signature(compiled)))
            self.dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self.dir / f"{key}.exe")
        except Exception as err:
            self._count("errors")
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
