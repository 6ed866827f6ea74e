"""`hybrid-jax serve` as a child process of `hybrid-jax bench serving`.

Latency figures are only honest when the client and the server do not share one Python
process (one GIL: at 16 req/s an in-process server reported 19x the TPOT a separate
server gives, issue 38), so without `--server` the benchmark starts the server with
the benchmark's model and engine flags on free localhost ports, waits for its health
to say SERVING, and stops it at the end (SIGTERM, then SIGKILL), also on an error or
Ctrl-C. The child's stderr (JSON log lines) is drained into OUT/serving_server.log;
its ports come from its `server.started` log record. This module imports no JAX.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

STOP_TIMEOUT_S = 30.0


class ServerStartError(OSError):
    """The child server exited or never reported SERVING (an OSError: the CLI prints it
    as one line, and most causes are the user's: a model that is not there, flags)."""


def serve_command(args: argparse.Namespace, max_model_len: int) -> list[str]:
    """`hybrid-jax serve` with the benchmark's model and engine flags, on free ports."""
    cmd = [sys.executable, "-m", "serving.entrypoints.cli", "serve", "--model", args.model,
           "--dtype", args.dtype,
           "--weights-seed", str(args.seed), "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
           "--max-waiting", str(max(128, args.num_requests)), "--shutdown-grace", "0",
           "--max-num-seqs", str(args.max_num_seqs),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--max-prefill-chunk", str(args.max_prefill_chunk), "--max-model-len", str(max_model_len),
           "--page-size", str(args.page_size), "--memory-fraction", str(args.memory_fraction),
           "--no-background-compile"]  # measured from the first request with every executable
    if getattr(args, "data_parallel_size", 1) > 1:
        cmd += ["--data-parallel-size", str(args.data_parallel_size)]
    if args.smoke:  # one bucket of each kind, as the in-process smoke engine
        cmd += ["--seq-buckets", str(args.max_num_seqs), "--token-buckets", str(args.max_num_batched_tokens)]
    else:
        for flag in ("seq_buckets", "token_buckets"):
            if getattr(args, flag, None):
                cmd += [f"--{flag.replace('_', '-')}", getattr(args, flag)]
    return cmd


class ServerProcess:
    """A running `hybrid-jax serve` child: `port`, `metrics_port`, `http_port` (None without
    --http-port); `stop()` ends it."""

    def __init__(self, cmd: list[str], log_path: Path, start_timeout_s: float):
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "w")  # noqa: SIM115 - closed by stop()
        self.log_path = log_path
        self._tail: deque[str] = deque(maxlen=20)
        self._started = threading.Event()
        self._record: dict = {}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, env=_child_env())
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()
        try:
            self._wait_started(start_timeout_s)
            self.port, self.metrics_port = self._record["port"], self._record["metrics_port"]
            self.http_port = self._record.get("http_port")  # with --http-port
            self._wait_serving(start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self._log.write(line)
            self._tail.append(line.rstrip("\n"))
            if not self._started.is_set() and line.startswith("{"):
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if record.get("event") == "server.started":
                    self._record = record
                    self._started.set()

    def _wait_started(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._started.wait(timeout=0.2):
            if self.proc.poll() is not None:
                self._reader.join(timeout=5)
                raise ServerStartError(f"the benchmark's server exited with code {self.proc.returncode} "
                                   f"before serving: {self._last_error()} (log: {self.log_path})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the benchmark's server did not start within {timeout_s:.0f} s "
                                   f"(--server-start-timeout; log: {self.log_path})")

    def _wait_serving(self, timeout_s: float) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while True:
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise ServerStartError("the benchmark's server never reported SERVING "
                                           f"(log: {self.log_path})")
                time.sleep(0.1)

    def _last_error(self) -> str:
        for line in reversed(self._tail):
            if line.strip():
                return line.strip()
        return "no output"

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after STOP_TIMEOUT_S; the exit code. Idempotent."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=STOP_TIMEOUT_S)
        self._reader.join(timeout=5)
        self._log.close()
        return self.proc.returncode


def _child_env() -> dict[str, str]:
    """This environment, plus this process's JAX compilation cache (a test run's or a
    user's), so a child of the same code and flags compiles what it must only once."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    if "jax" in sys.modules:  # only if something imported it; this module never does
        cache = sys.modules["jax"].config.jax_compilation_cache_dir
        if cache and "JAX_COMPILATION_CACHE_DIR" not in env:
            env["JAX_COMPILATION_CACHE_DIR"] = cache
    return env
