"""serving.engine.memory: the memory budget base without an accelerator comes from the machine
(MemAvailable, a cgroup limit, free pages), and from the allocator's statistics with one."""

from __future__ import annotations

import os

import jax

from serving.engine import memory
from serving.engine.memory import cgroup_available_bytes, device_free_bytes, host_available_bytes

MEMINFO = """MemTotal:       16000000 kB
MemFree:         1000000 kB
MemAvailable:    9000000 kB
Buffers:          100000 kB
"""


def test_meminfo_mem_available_is_read(tmp_path):
    (tmp_path / "meminfo").write_text(MEMINFO)
    assert host_available_bytes(tmp_path / "meminfo") == 9_000_000 * 1024


def test_without_meminfo_free_pages_are_used(tmp_path):
    want = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    got = host_available_bytes(tmp_path / "absent")
    assert abs(got - want) < 256 << 20  # free memory moves a little between the two reads


def test_cgroup_v2_limit_leaves_limit_minus_usage(tmp_path):
    assert cgroup_available_bytes(tmp_path) is None  # no cgroup files
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text("123\n")
    assert cgroup_available_bytes(tmp_path) is None  # no limit
    (tmp_path / "memory.max").write_text(f"{8 << 30}\n")
    (tmp_path / "memory.current").write_text(f"{3 << 30}\n")
    assert cgroup_available_bytes(tmp_path) == 5 << 30


class _Device:
    def __init__(self, platform: str, stats: dict | None):
        self.platform, self._stats = platform, stats

    def memory_stats(self):
        return self._stats


def test_accelerator_statistics_give_limit_minus_in_use():
    gpu = _Device("gpu", {"bytes_limit": 80 << 30, "bytes_in_use": 30 << 30})
    assert device_free_bytes(gpu) == 50 << 30
    assert device_free_bytes(_Device("gpu", None)) is None  # unknown: the caller decides


def test_cpu_budget_is_the_smaller_of_host_and_cgroup(tmp_path, monkeypatch):
    (tmp_path / "meminfo").write_text(MEMINFO)
    (tmp_path / "memory.max").write_text(f"{2 << 30}\n")
    (tmp_path / "memory.current").write_text(f"{1 << 30}\n")
    monkeypatch.setattr(memory, "host_available_bytes", lambda: host_available_bytes(tmp_path / "meminfo"))
    monkeypatch.setattr(memory, "cgroup_available_bytes", lambda: cgroup_available_bytes(tmp_path))
    assert device_free_bytes(_Device("cpu", None)) == 1 << 30


def test_this_machine_reports_a_plausible_figure():
    free = device_free_bytes()
    assert free is not None and free > 0
    if jax.devices()[0].platform == "cpu":
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        assert free <= total
