"""Data parallelism (issue 44): N engine replicas behind one server serve what one engine serves.

The engine checks run in a child process that sees 4 CPU devices
(`data_parallel_child.py`; XLA_FLAGS must be set before JAX starts, and this process has
already started it with one device): with native-tiny (f32) two replicas on devices 0
and 1 serve greedy prompts with replica 0's tokens alone, each holding its arrays on
its own device (no device-to-device copy while building or serving), the requests
spread over both; an abort on replica 1, the gRPC server over two replicas, the
health rules (degraded while any replica is; one replica's fatal fault is the
server's); and dp=2 x tp=2 on 4 devices. In another child, `hybrid-jax serve
--data-parallel-size 2` under `bench serving`'s load. Here, in-process: the refusals,
the stats merge, the executable-store key shared by the replicas.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from serving.engine.data_parallel import check_devices, merge_stats, replica_configs
from serving.engine.engine_config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]
FLAGS = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()


def _child(*argv: str) -> dict[str, object]:
    env = dict(os.environ, XLA_FLAGS=FLAGS,
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("data_parallel_child.py")), *argv],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(lines[-1][len("RESULTS "):])
    assert "child crashed" not in results, results["child crashed"]
    return results


def _failed(results: dict[str, object]) -> dict[str, object]:
    return {k: v for k, v in results.items() if not k.startswith("seconds") and v is not True}


def test_two_replicas_serve_what_one_engine_serves():
    results = _child()
    checks = {k for k in results if not k.startswith("seconds")}
    assert len(checks) == 13, sorted(checks)
    assert not _failed(results), _failed(results)


def test_two_tensor_parallel_replicas_on_four_devices():
    results = _child("tp")
    assert len([k for k in results if not k.startswith("seconds")]) == 2, results
    assert not _failed(results), _failed(results)


def test_serve_cli_with_two_replicas_under_the_load_generator(tmp_path):
    """`hybrid-jax serve --data-parallel-size 2` (the child server of `bench serving`) on 2
    CPU devices: every request answered as by one engine (the too long ones refused)."""
    env = dict(os.environ, XLA_FLAGS=FLAGS.replace("count=4", "count=2"), JAX_PLATFORMS="cpu",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, "-m", "serving.entrypoints.cli", "bench", "serving", "--smoke",
                           "--data-parallel-size", "2", "--out", str(tmp_path)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "serving.json").read_text())
    log = (tmp_path / "serving_server.log").read_text()
    assert "data-parallel replica 2 of 2 on devices 1..1" in log
    too_long = [p + m > res["max_model_len"]
                for p, m in zip(res["input_lens"], res["max_tokens"], strict=True)]
    assert res["sent"] == 12 and 0 < sum(too_long) < 12
    assert res["failures_by_code"] == {"INVALID_ARGUMENT": sum(too_long)}
    assert [o for o, bad in zip(res["output_lens"], too_long, strict=True) if not bad] == \
        [m for m, bad in zip(res["max_tokens"], too_long, strict=True) if not bad]
    assert res["server_counted"]["finished_length"] == res["completed"] == 12 - sum(too_long)


def test_refusals_name_the_setting():
    with pytest.raises(ValueError, match="data_parallel_size=0 must be >= 1"):
        EngineConfig(data_parallel_size=0)
    with pytest.raises(ValueError, match="device_offset=-1 must be >= 0"):
        EngineConfig(device_offset=-1)
    with pytest.raises(ValueError, match=r"data_parallel_size=3 x tensor_parallel_size=2 needs 6 devices, "
                                         r"but this host has 4: lower data_parallel_size"):
        check_devices(EngineConfig(data_parallel_size=3, tensor_parallel_size=2), num_devices=4)
    check_devices(EngineConfig(data_parallel_size=2, tensor_parallel_size=2), num_devices=4)
    with pytest.raises(ValueError, match=r"needs 3 devices from device_offset=1"):
        check_devices(EngineConfig(data_parallel_size=2, device_offset=1), num_devices=2)
    with pytest.raises(ValueError, match="data_parallel_size=2 .* needs 2 devices, but this host has 1"):
        replica_configs(EngineConfig(data_parallel_size=2))  # this process sees one device


def test_engine_refuses_a_device_offset_beyond_the_host_and_several_replicas_before_loading(monkeypatch):
    import hybrid_jax.loading
    import serving.engine.startup
    from serving.engine.llm_engine import LLMEngine

    def no_loading(*a, **k):
        raise AssertionError("loaded before refusing")

    monkeypatch.setattr(serving.engine.startup, "load_model", no_loading)
    monkeypatch.setattr(hybrid_jax.loading, "load_model", no_loading)
    with pytest.raises(ValueError, match=r"device_offset=1 with tensor_parallel_size=1 needs devices 1..1, "
                                         r"but this host has 1 cpu device\(s\): lower device_offset"):
        LLMEngine("native-tiny", EngineConfig(device_offset=1), show_progress=False)
    with pytest.raises(ValueError, match="data_parallel_size=2: an LLMEngine is one replica"):
        LLMEngine("native-tiny", EngineConfig(data_parallel_size=2), show_progress=False)


def test_cli_refuses_more_replicas_than_devices_before_loading(capsys):
    from serving.entrypoints.cli import main

    assert main(["serve", "--model", "native-tiny", "--data-parallel-size", "2", "--port", "0",
                 "--metrics-port", "-1"]) == 2
    err = capsys.readouterr().err
    assert "data_parallel_size=2 x tensor_parallel_size=1 needs 2 devices" in err, err
    assert "loading" not in err


def test_replicas_share_one_store_key():
    """The device group is not part of the configuration key (the store keys on the devices)."""
    cfgs = [EngineConfig(data_parallel_size=2, tensor_parallel_size=2, device_offset=o) for o in (0, 2)]
    assert cfgs[0].store_key() == cfgs[1].store_key() == EngineConfig(tensor_parallel_size=2).store_key()


def test_stats_sum_counts_keep_per_device_keys_and_recompute_rates():
    a = {"weight_bytes": 100, "weight_bytes_by_dtype": {"float32": 100}, "quantization": None,
         "kv_cache_dtype": "float32", "kv_bytes": 10, "pages_in_use": {"g0": 3, "g1": 1},
         "num_running": 2, "prefix_cache_hit_tokens": 30, "prefix_cache_query_tokens": 40,
         "prefix_cache_hit_rate": 0.75, "spec_proposed_tokens": 10, "spec_accepted_tokens": 5,
         "spec_acceptance_rate": 0.5, "spec_verify_steps": 1, "spec_mean_accepted_length": 2.0,
         "spec_acceptance_per_position": [1.0, 0.0]}
    b = {**a, "pages_in_use": {"g0": 1, "g1": 0}, "num_running": 1, "prefix_cache_hit_tokens": 0,
         "prefix_cache_query_tokens": 60, "prefix_cache_hit_rate": 0.0, "spec_proposed_tokens": 30,
         "spec_accepted_tokens": 25, "spec_acceptance_rate": 25 / 30, "spec_verify_steps": 3,
         "spec_mean_accepted_length": 4.0, "spec_acceptance_per_position": [0.0, 1.0]}
    out = merge_stats([a, b])
    assert out["weight_bytes"] == 100 and out["weight_bytes_by_dtype"] == {"float32": 100}
    assert out["quantization"] is None and out["kv_cache_dtype"] == "float32"
    assert out["kv_bytes"] == 20 and out["num_running"] == 3 and out["pages_in_use"] == {"g0": 4, "g1": 1}
    assert out["prefix_cache_hit_rate"] == pytest.approx(30 / 100)
    assert out["spec_acceptance_rate"] == pytest.approx(30 / 40)
    assert out["spec_mean_accepted_length"] == pytest.approx(0.25 * 2.0 + 0.75 * 4.0)
    assert out["spec_acceptance_per_position"] == pytest.approx([0.25, 0.75])
