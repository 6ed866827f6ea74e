"""`hybrid-jax serve` and `hybrid-jax client` as real processes: end to end, SIGTERM under
load (streams end with a result or a status, exit 0), JSON logs, and `--help`."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest

from hybrid_jax.generate import greedy_generate
from hybrid_jax.loading import load_model
from serving.engine.engine_config import EngineConfig
from serving.entrypoints.cli import main
from serving.entrypoints.cli_args import ENGINE_DEFAULTS
from serving.proto.hybrid_jax.v1 import generation_pb2_grpc as pb_grpc
from serving.sample.sampling_params import SamplingParams
from tests.serving.server_helpers import request_for

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
SERVE = [sys.executable, "-m", "serving.entrypoints.cli", "serve", "--model", "native-tiny",
         "--host", "127.0.0.1",
         "--port", "0", "--metrics-port", "0", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
         "--max-prefill-chunk", "16", "--max-model-len", "256", "--page-size", "8",
         "--shutdown-grace", "0.3"]


class ServerProcess:
    """`hybrid-jax serve` in a subprocess; its JSON log lines are collected as they come."""

    def __init__(self):
        self.proc = subprocess.Popen(SERVE, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.events: list[dict] = []
        self.raw: list[str] = []  # every stderr line, for failure messages
        threading.Thread(target=self._read, daemon=True).start()
        started = self.wait_event("server.started", timeout=240)
        self.port, self.metrics_port = started["port"], started["metrics_port"]

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.put(line)

    def wait_event(self, event: str, timeout: float) -> dict:
        """The first log record with this event (others are kept in self.events)."""
        for e in self.events:
            if e.get("event") == event:
                return e
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                tail = "".join(self.raw[-10:])
                raise AssertionError(f"no {event} within {timeout}s; exit code {self.proc.poll()}; "
                                     f"stderr tail:\n{tail}") from None
            self.raw.append(line)
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # the compile progress bar and other non-JSON output
            self.events.append(record)
            if record.get("event") == event:
                return record


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess()
    try:
        yield proc
    finally:
        if proc.proc.poll() is None:
            proc.proc.kill()
            proc.proc.wait(timeout=30)


def test_client_streams_the_greedy_continuation_from_the_server(server):
    out = subprocess.run([sys.executable, "-m", "serving.entrypoints.cli", "client", "--server",
                          f"127.0.0.1:{server.port}", "--max-tokens", "8", "--temperature", "0",
                          "--request-id", "cli-e2e", "--usage", "Hi"],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lm = load_model("native-tiny")
    tokens = greedy_generate(lm.model, lm.tokenizer.encode("Hi", add_bos=True), 8,
                             eos_ids=lm.config.eos_token_ids)
    assert out.stdout == "Hi" + lm.tokenizer.decode(tokens) + "\n"
    assert f"completion_tokens={len(tokens)}" in out.stderr
    finished = server.wait_event("request.finished", timeout=30)
    assert finished["request_id"] == "cli-e2e" and finished["completion_tokens"] == len(tokens)


def test_loading_is_logged_before_the_compile_and_the_host_is_reported(server):
    names = [e.get("event") for e in server.events]
    assert "server.loading" in names and names.index("server.loading") < names.index("server.started")
    raw = "".join(server.raw)
    assert raw.index('"server.loading"') < raw.index("compiling step executables")
    assert server.wait_event("server.started", timeout=1)["host"] == "127.0.0.1"


def test_start_up_stderr_is_the_servers_own_lines(server):
    """Start-up shows this project's log lines (JSON) and the compile progress, no library
    internals below WARNING (JAX's TPU probe, orbax), one line that the preset's weights
    are random, and the self-test before SERVING."""
    started = [e.get("event") for e in server.events].index("server.started")
    records = server.events[:started + 1]
    foreign = [e for e in records if e["logger"].split(".")[0] not in ("serving", "hybrid_jax")]
    assert all(e["level"] in ("warning", "error", "critical") for e in foreign), foreign
    assert not any("Unable to initialize backend" in line for line in server.raw)
    notes = [e for e in records if e.get("event") == "server.model"]
    assert len(notes) == 1 and notes[0]["level"] == "warning" and "random weights" in notes[0]["message"]
    names = [e.get("event") for e in records]
    assert names.index("server.self_test") < names.index("server.started")
    other = [line for line in server.raw if not line.startswith("{")]
    assert all("compiling step executables" in line for line in other if line.strip()), other


def test_client_reports_a_bad_request_with_its_status(server):
    out = subprocess.run([sys.executable, "-m", "serving.entrypoints.cli", "client", "--server",
                          f"127.0.0.1:{server.port}", "--top-p", "0", "Hi"],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "INVALID_ARGUMENT" in out.stderr and "top_p" in out.stderr


def test_sigterm_under_load_ends_every_stream_and_exits_0(server):
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))
    params = [SamplingParams(temperature=0.0, max_tokens=4 if i < 2 else 200, ignore_eos=True)
              for i in range(8)]
    calls = [stub.Generate(request_for(f"load {i}", p), timeout=120) for i, p in enumerate(params)]
    firsts = [next(c) for c in calls[2:]]  # the long ones are in flight (or queued and started)
    assert len(firsts) == 6
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=120) == 0
    outcomes = []
    for call in calls:
        try:
            last = list(call)
            outcomes.append("finished" if last[-1].finish_reason else "cut")
        except grpc.RpcError as err:
            outcomes.append(err.code())
    assert outcomes[:2] == ["finished", "finished"]
    # Each long stream either finished within the 0.3 s grace or was aborted with a status;
    # which one depends on the machine's speed (the in-process shutdown tests pin both paths).
    assert set(outcomes[2:]) <= {"finished", grpc.StatusCode.UNAVAILABLE}
    assert server.wait_event("server.stopping", timeout=10)["in_flight"] >= 1
    server.wait_event("server.stopped", timeout=10)


@pytest.mark.parametrize("command", [[], ["serve"], ["client"], ["generate"]])
def test_help_explains_every_command(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "usage: hybrid-jax" in out
    assert "example" in out
    if command == ["serve"]:
        for flag in ("--port", "--metrics-port", "--max-waiting", "--max-num-seqs", "--max-model-len",
                     "--max-num-batched-tokens", "--max-prefill-chunk", "--page-size", "--dtype",
                     "--shutdown-grace", "SIGTERM"):
            assert flag in out
    if command == ["client"]:
        for flag in ("--server", "--max-tokens", "--temperature", "--top-p", "--seed", "--stop"):
            assert flag in out


def test_serve_defaults_shown_in_help_are_the_engine_defaults():
    d = EngineConfig()
    assert {k: getattr(d, k) for k in ENGINE_DEFAULTS} == ENGINE_DEFAULTS
