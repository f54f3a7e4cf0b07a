"""How much memory this process may use: the cgroup's limit, the machine's available memory, the address-space
limit and ``POLICY_BUNDLE_MEMORY_LIMIT``. The build's memory plan and the server's KV-cache budget read it."""

from __future__ import annotations

import os
import resource
from pathlib import Path
from typing import Optional


def memory_limit() -> tuple[Optional[int], str]:
    """The most memory the build may use: the cgroup's limit, the machine's available memory, the address-space
    limit and ``POLICY_BUNDLE_MEMORY_LIMIT`` (GB), whichever is least."""
    meminfo = Path("/proc/meminfo")
    lines = meminfo.read_text().splitlines() if meminfo.is_file() else []
    found = [(int(line.split()[1]) * 1024, "MemAvailable") for line in lines if line.startswith("MemAvailable:")]
    for limit_file, usage_file in _cgroup_files():
        try:
            raw = Path(limit_file).read_text().strip()
            if raw != "max" and int(raw) < 2**60:
                found.append((int(raw), f"cgroup {limit_file}"))
        except (OSError, ValueError):
            continue
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft not in (resource.RLIM_INFINITY, -1):
        found.append((soft, "RLIMIT_AS"))
    override = os.environ.get("POLICY_BUNDLE_MEMORY_LIMIT")
    if override:
        found.append((int(float(override) * 2**30), "POLICY_BUNDLE_MEMORY_LIMIT (GB)"))
    if not found:
        return None, "unknown"
    return min(found)


def _cgroup_files() -> list:
    """(limit, usage) files of this process's memory cgroup and its parents (cgroup v2 and v1). The limit counts, not
    the usage: that includes the page cache, which the kernel reclaims before it kills."""
    out = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base, files = Path("/sys/fs/cgroup"), ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            base, files = Path("/sys/fs/cgroup/memory"), ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for i in range(len(parts), -1, -1):
            d = base.joinpath(*parts[:i])
            out.append((str(d / files[0]), str(d / files[1])))
    return out
