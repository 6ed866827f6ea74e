"""How much memory the engine may plan its KV pages and states in.

`device_free_bytes()` answers for the default JAX device: an accelerator's
allocator statistics (bytes_limit - bytes_in_use), or, on a CPU (no statistics),
the machine's available memory (MemAvailable from /proc/meminfo, else free pages
from os.sysconf; lowered to what the container's cgroup v2 limit leaves), so that
a CPU budget follows the machine instead of a fixed size. None when nothing is
known. This module knows nothing of models or pools.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")  # cgroup v2: memory.max, memory.current


def device_free_bytes(device: jax.Device | None = None) -> int | None:
    """Free bytes of `device` (default: the first device), or None when unknown."""
    device = device or jax.devices()[0]
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    if limit is not None:
        return max(int(limit - stats.get("bytes_in_use", 0)), 0)
    if device.platform == "cpu":
        known = [b for b in (host_available_bytes(), cgroup_available_bytes()) if b is not None]
        return min(known) if known else None
    return None


def cgroup_available_bytes(root: Path = CGROUP) -> int | None:
    """memory.max - memory.current of this process's cgroup (v2), or None without a limit."""
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(int(limit) - int((root / "memory.current").read_text()), 0)
    except (OSError, ValueError):
        return None


def host_available_bytes(meminfo: Path = MEMINFO) -> int | None:
    """The host's available memory: MemAvailable (Linux), else free pages; None if unknown.

    MemAvailable counts reclaimable page cache, which MemFree does not.
    """
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                value, unit = line.split()[1:3]
                if unit.lower() != "kb":
                    break
                return int(value) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None
