"""The executable store (serving/runner/exec_store.py): a warm start loads every step executable
without tracing and serves exactly what a cold start serves; a changed setting misses; a
damaged file is compiled again, never trusted."""

from __future__ import annotations

import os

import pytest

import serving.runner.exec_store as exec_store
from hybrid_jax.loading import load_model
from serving.engine.engine_config import EngineConfig
from serving.engine.llm_engine import LLMEngine
from serving.sample.sampling_params import SamplingParams

PROMPTS = [[1, 5, 9, 13, 7, 22, 3], [4, 8], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43]]


# The suite's flags (tests/conftest.py) and the forced host devices.
FLAGS = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2".strip()


@pytest.fixture(scope="module")
def lm():
    return load_model("native-tiny")


@pytest.fixture
def store_dir(tmp_path, monkeypatch):
    """Engines built in the test use a store in tmp_path."""
    stores = []

    def make(devices):
        stores.append(exec_store.ExecutableStore(tmp_path, devices))
        return stores[-1]

    monkeypatch.setattr(exec_store, "default_store", make)
    return tmp_path, stores


def _engine(lm, **kw) -> LLMEngine:
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128, seq_buckets=(4,),
               token_buckets=(16,), num_pages=64)
    return LLMEngine(lm, EngineConfig(**(cfg | kw)), show_progress=False)


def _serve(engine: LLMEngine) -> list[list[int]]:
    out: dict[str, list[int]] = {}
    for i, p in enumerate(PROMPTS):
        engine.add_request(prompt_token_ids=p, request_id=str(i),
                           params=SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True))
    while engine.has_unfinished():
        for d in engine.step():
            out.setdefault(d.request_id, []).extend(d.token_ids)
    return [out[str(i)] for i in range(len(PROMPTS))]


def test_warm_start_loads_every_executable_and_serves_the_same(lm, store_dir):
    path, stores = store_dir
    cold = _engine(lm)
    n = cold.runner.startup["executables"]
    assert cold.runner.startup["loaded"] == 0 and stores[-1].misses == n
    assert len(list(path.glob("*.exe"))) == n
    expected = _serve(cold)

    warm = _engine(lm)
    assert warm.runner.startup["loaded"] == n and stores[-1].hits == n
    assert _serve(warm) == expected

    # A setting that changes the executables misses (different bucket ladder).
    other = _engine(lm, seq_buckets=(2, 4))
    assert other.runner.startup["loaded"] < other.runner.startup["executables"]
    assert _serve(other) == expected

    # Damaged files are compiled again (and replaced), never trusted.
    for f in path.glob("*.exe"):
        f.write_bytes(b"not an executable")
    again = _engine(lm)
    assert again.runner.startup["loaded"] == 0 and stores[-1].errors == n
    assert _serve(again) == expected
    assert _engine(lm).runner.startup["loaded"] == n  # rewritten by the compile


def test_key_covers_environment_and_arguments(monkeypatch, tmp_path):
    import jax
    import jax.numpy as jnp

    devices = jax.devices()[:1]
    a = exec_store.ExecutableStore(tmp_path, devices)
    monkeypatch.setenv("HYBRID_JAX_SOME_SWITCH", "1")
    b = exec_store.ExecutableStore(tmp_path, devices)
    assert a.key("x") != b.key("x")
    monkeypatch.delenv("HYBRID_JAX_SOME_SWITCH")
    assert a.key("x") == exec_store.ExecutableStore(tmp_path, devices).key("x")
    monkeypatch.setenv("HYBRID_JAX_API_KEY", "secret")  # secrets never reach a key
    assert a.key("x") == exec_store.ExecutableStore(tmp_path, devices).key("x")
    with jax.default_matmul_precision("highest"):  # a setting that changes tracing
        assert a.key("x") != exec_store.ExecutableStore(tmp_path, devices).key("x")
    f32 = jax.ShapeDtypeStruct((4, 3), jnp.float32)
    bf16 = jax.ShapeDtypeStruct((4, 3), jnp.bfloat16)
    wider = jax.ShapeDtypeStruct((4, 4), jnp.float32)
    descs = {exec_store.describe_args(t) for t in [(f32,), (bf16,), (wider,), ((f32,),), (f32, None)]}
    assert len(descs) == 5
    monkeypatch.setenv("HYBRID_JAX_EXECUTABLE_STORE", "0")
    assert exec_store.default_store(devices) is None
    monkeypatch.setenv("HYBRID_JAX_EXECUTABLE_STORE", "1")
    assert exec_store.default_store(devices) is not None  # the session's cache dir is set
    monkeypatch.delenv("HYBRID_JAX_EXECUTABLE_STORE")
    assert (exec_store.default_store(devices) is not None) == (jax.default_backend() == "gpu")


def test_prune_deletes_the_least_recently_used_files_first(tmp_path):
    import os

    import jax

    store = exec_store.ExecutableStore(tmp_path, jax.devices()[:1], max_bytes=250)
    for i, name in enumerate("abcd"):  # a oldest ... d newest, 100 bytes each
        f = tmp_path / f"{name}.exe"
        f.write_bytes(b"x" * 100)
        os.utime(f, (1000 + i, 1000 + i))
    os.utime(tmp_path / "a.exe", (2000, 2000))  # a was loaded last: kept
    (tmp_path / "notes.txt").write_bytes(b"y" * 1000)  # not an executable: never counted
    assert store.prune() == 2
    assert sorted(f.name for f in tmp_path.glob("*.exe")) == ["a.exe", "d.exe"]
    assert store.prune() == 0 and (tmp_path / "notes.txt").exists()
    assert exec_store.ExecutableStore(tmp_path, jax.devices()[:1]).max_bytes == exec_store.DEFAULT_MAX_BYTES


@pytest.fixture(scope="module")
def two_device_results(tmp_path_factory) -> dict[str, str]:
    """Run `exec_store_child.py` on 2 forced CPU devices (XLA_FLAGS must be set before JAX
    starts; this process has one device) and return its check results."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, XLA_FLAGS=FLAGS, JAX_PLATFORMS="cpu",
               PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("exec_store_child.py")),
                           str(tmp_path_factory.mktemp("store"))],
                          env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("check", ["mismatch_is_a_miss", "tensor_parallel_then_another_model_twice"])
def test_store_on_a_host_of_two_devices(two_device_results, check):
    """A stored executable runs on exactly the engine's devices: a TP=2 engine starts
    twice from one store (the second loads everything, same tokens); then a TP=1 engine
    of another model of the same vocabulary on the same 2-device host starts twice (the
    second loads every executable) and serves the full forward's tokens both times; an
    executable that does not fit the engine is a miss."""
    assert two_device_results[check] == "ok", two_device_results[check]
