"""Tracing a running server: a jax.profiler trace and a per-step log, started and stopped
from outside (`hybrid-jax serve --profile-dir DIR`: POST /start_profile, /stop_profile).

While a profile runs, the engine's step and its phases are wrapped in
`jax.profiler.TraceAnnotation` scopes (`trace_scopes`, the same names the benchmarks use)
and every dispatched step is logged: `DIR/steps-N.jsonl`, one line per step with the
seconds since the profile started, its sequences, decoding sequences and tokens. The log
answers "which steps were slow and what did they carry" without opening the trace; the
trace (`DIR/plugins/profile/...`, TensorBoard / xprof / Perfetto) says where the time went.

On a GPU only the step log is recorded unless HYBRID_JAX_PROFILE_DEVICE=1: with jax 0.11.2
on an H100, a CUPTI trace of the running server made a later step fail with
CUDA_ERROR_LAUNCH_FAILED and poisoned the CUDA context, during the trace or after
stop_trace (2026-11-28, twice in two tries; jax-ml/jax#40260 reports the same), which the
engine can only answer by exiting.

The wrapping replaces attributes of the engine's objects, which the engine thread reads
at every call, so it can be installed and removed while the engine runs. This module is
imported by the HTTP front only when --profile-dir is given.
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import jax

from configs import switches

# (owner attribute on the engine or "" for the engine itself, method, scope name)
SCOPES = (("scheduler", "schedule", "schedule"), ("", "_sampling", "host_prep"),
          ("runner", "dispatch", "device_step"), ("runner", "fetch", "fetch"),
          ("scheduler", "update", "update"))


@contextlib.contextmanager
def trace_scopes(engine) -> Iterator[list[str]]:
    """Wrap the engine's step and phases in jax.profiler.TraceAnnotation scopes.

    Yields the scope names installed (phases the engine does not have are skipped);
    the original methods are restored on exit.
    """
    patched: list[tuple[object, str]] = []
    names = ["engine_step"]
    _wrap(engine, "step", "engine_step", patched)
    for owner_name, method, scope in SCOPES:
        owner = getattr(engine, owner_name, None) if owner_name else engine
        if owner is not None and callable(getattr(owner, method, None)):
            _wrap(owner, method, scope, patched)
            names.append(scope)
    try:
        yield names
    finally:
        for owner, method in reversed(patched):
            with contextlib.suppress(AttributeError):
                delattr(owner, method)


def _wrap(owner: object, method: str, scope: str, patched: list) -> None:
    fn = getattr(owner, method)

    @functools.wraps(fn)
    def annotated(*args, **kwargs):
        with jax.profiler.TraceAnnotation(scope):
            return fn(*args, **kwargs)

    setattr(owner, method, annotated)
    patched.append((owner, method))


class ServerProfiler:
    """One profile at a time of `engine` into `directory` (start() / stop(), any thread)."""

    def __init__(self, engine, directory: str | Path, trace: bool | None = None):
        self.engine, self.directory = engine, Path(directory)
        # trace: a jax.profiler trace beside the step log (default: not on GPUs, see above)
        self.trace = (jax.default_backend() != "gpu" or switches.profile_device()) if trace is None else trace
        self._lock = threading.Lock()
        self._scopes: contextlib.ExitStack | None = None
        self._steps: list[dict] = []
        self._t0 = 0.0
        self._count = 0

    @property
    def running(self) -> bool:
        return self._scopes is not None

    def start(self) -> None:
        """Start a trace; ValueError if one is running."""
        with self._lock:
            if self._scopes is not None:
                raise ValueError("a profile is already running (POST /stop_profile first)")
            self.directory.mkdir(parents=True, exist_ok=True)
            stack = contextlib.ExitStack()
            if self.trace:
                jax.profiler.start_trace(str(self.directory))
                stack.enter_context(trace_scopes(self.engine))
            stack.enter_context(self._step_log())
            self._steps, self._t0 = [], time.perf_counter()
            self._scopes = stack

    def stop(self) -> dict:
        """Stop the trace and write the step log; returns where both are. ValueError if
        no profile is running."""
        with self._lock:
            if self._scopes is None:
                raise ValueError("no profile is running (POST /start_profile first)")
            self._scopes.close()
            self._scopes = None
            if self.trace:
                jax.profiler.stop_trace()
            self._count += 1
            log = self.directory / f"steps-{self._count}.jsonl"
            with open(log, "w") as f:
                for rec in self._steps:
                    f.write(json.dumps(rec) + "\n")
            return {"trace_dir": str(self.directory) if self.trace else None, "step_log": str(log),
                    "steps": len(self._steps)}

    @contextlib.contextmanager
    def _step_log(self) -> Iterator[None]:
        runner = self.engine.runner
        dispatch = runner.dispatch  # the scoped one when tracing: trace_scopes is entered first

        @functools.wraps(dispatch)
        def logged(arrays, *args, **kwargs):
            t = time.perf_counter() - self._t0
            self._steps.append({"t_s": round(t, 6), "seqs": int(len(arrays.slot_ids)),
                                "decodes": int(arrays.num_decodes), "tokens": int(len(arrays.token_ids))})
            return dispatch(arrays, *args, **kwargs)

        had = "dispatch" in vars(runner)
        runner.dispatch = logged
        try:
            yield
        finally:
            if had:
                runner.dispatch = dispatch
            else:
                del runner.dispatch
