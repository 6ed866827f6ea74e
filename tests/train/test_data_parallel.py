"""Data parallelism over a Mesh of 1, 2 and 4 (fake CPU) devices gives the 1-device result.

The runs happen in a subprocess (tests/train/dp_worker.py) started with
XLA_FLAGS=--xla_force_host_platform_device_count=4: this process's jax has already
started with one CPU device. The reference is the same train() on one device (no
mesh communication at all); parameters and losses must agree to f32 reduction-order
tolerance, and an interrupted 4-device run resumed from its orbax checkpoint must
equal the uninterrupted 4-device run exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


# The suite's flags (tests/conftest.py) and the forced host devices.
FLAGS = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp")
    env = os.environ | {"XLA_FLAGS": FLAGS, "JAX_PLATFORMS": "cpu",
                        "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "tests.train.dp_worker", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    arrays = np.load(out / "results.npz")
    return json.loads((out / "results.json").read_text()), {k: arrays[k] for k in arrays.files}


def _leaves(arrays: dict, name: str) -> list[np.ndarray]:
    n = sum(k.startswith(name + "/") for k in arrays)
    assert n > 0, name
    return [arrays[f"{name}/{i}"] for i in range(n)]


def _max_diff(arrays, a: str, b: str) -> float:
    pairs = zip(_leaves(arrays, a), _leaves(arrays, b), strict=True)
    return max(float(np.abs(x - y).max()) for x, y in pairs)


pytestmark = pytest.mark.slow  # one subprocess, 5 distinct compilations of the step (~20 s idle CPU)


@pytest.mark.parametrize(("name", "ref"), [("d2_a1", "d1_a1"), ("d4_a1", "d1_a1"), ("d4_a2", "d1_a2")])
def test_data_parallel_equals_one_device(results, name, ref):
    info, arrays = results
    assert info[name]["num_devices"] == int(name[1])  # the run log names the device count
    assert info[name]["param_devices"] == [int(name[1])]  # parameters replicated on the mesh
    assert info[ref]["num_devices"] == 1
    assert _max_diff(arrays, name, ref) < 2e-5
    np.testing.assert_allclose(info[name]["train_loss"], info[ref]["train_loss"], rtol=2e-6)
    if info[ref]["eval_loss"] is not None:  # 3 held-out rows, padded to a multiple of the devices
        np.testing.assert_allclose(info[name]["eval_loss"], info[ref]["eval_loss"], rtol=2e-6)
    # the comparison can fail: accumulation changes the result (per-micro-batch loss means)
    assert _max_diff(arrays, "d1_a1", "d1_a2") > 1e-4


def test_checkpoint_on_four_devices_resumes_exactly(results):
    info, arrays = results
    assert info["resume"] == {"first_step": 2, "resumed_step": 4}
    assert _max_diff(arrays, "resumed", "d4_a2") == 0.0
    assert _max_diff(arrays, "first", "d4_a2") > 1e-4


def test_micro_batch_not_divisible_by_the_devices_is_refused(results):
    info, _ = results
    assert info["refused"] is not None
    assert "batch_size=6" in info["refused"] and "4 devices" in info["refused"]
