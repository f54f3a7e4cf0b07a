"""Lanes: several ``BatchedEngine``s (decode threads) on one loaded module, a request to the least loaded."""

from __future__ import annotations

import math
import os
import threading
from contextlib import aclosing
from pathlib import Path
from typing import AsyncIterator, List

from policy_bundle.serve.variants.engines import SamplingParams, Step


class Lanes:
    """``generate`` on whichever of several ``BatchedEngine`` lanes (one decode thread each, on one shared module)
    has the fewest requests of its own; ties go to the first, so a lone client always decodes on lane 0.

    Why lanes: one decode thread cannot use a second core, as its intra-op threads stay at one (``engine_threads``:
    the arithmetic the gate decoded with); a second lane decodes other requests beside it (figures in
    docs/benchmarks.md, "The batched engine's threads and lanes")."""

    def __init__(self, engines: List, name: str):
        self.lanes, self.name = engines, name
        self._load = [0] * len(engines)  # requests handed to each lane and not yet finished (or dropped)
        self._lock = threading.Lock()  # callers on several event loops or threads (BentoML's workers)

    async def generate(self, prompt_ids: List[int], params: SamplingParams) -> AsyncIterator[Step]:
        with self._lock:
            lane = min(range(len(self.lanes)), key=self._load.__getitem__)
            self._load[lane] += 1
        try:
            async with aclosing(self.lanes[lane].generate(prompt_ids, params)) as steps:
                async for step in steps:
                    yield step
        finally:
            with self._lock:
                self._load[lane] -= 1

    def stats(self) -> dict:
        """The lanes' counts summed (their peak batch: the largest), and each lane's own under ``per_lane``."""
        per = [e.stats() for e in self.lanes]
        total = {k: sum(s[k] for s in per) for k in ("active", "pending", "kv_blocks", "steps", "fused_chunks",
                                                     "kv_allocated_bytes", "kv_refused", "busy_refused")}
        waits = [s.get("queue_wait_s") or {} for s in per]  # the slowest lane's
        worst = max(per, key=lambda s: s["last_step_age_s"] - s["step_allowance_s"])
        return {**total, "kv_held_bytes": per[0]["kv_held_bytes"], "kv_budget_bytes": per[0]["kv_budget_bytes"],
                "kv_bytes_per_token": per[0]["kv_bytes_per_token"],
                "queue_wait_s": {q: max(w[q] for w in waits if q in w) for q in ("0.5", "0.99")
                                 if any(q in w for w in waits)}, "max_batch": sum(s["max_batch"] for s in per), "peak_batch": max(s["peak_batch"] for s in per),
                # the lane furthest past its step's allowance (``VariantPool._stalled`` compares the two)
                "last_step_age_s": worst["last_step_age_s"], "step_allowance_s": worst["step_allowance_s"],
                "decode_thread_alive": all(s["decode_thread_alive"] for s in per), "lanes": len(per), "per_lane": per}

    def score(self, batch: List[List[int]]) -> List[List[float]]:
        return self.lanes[0].score(batch)


def usable_cores(cgroup_cpu_max: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """The cores this process may run on: its CPU affinity (the machine's count where there is no affinity call),
    and no more than its cgroup's CPU quota (a container limited to 2 CPUs on a 64-core node: 2)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        quota, period = cgroup_cpu_max.read_text().split()[:2]
        limit = cores if quota == "max" else max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):  # no cgroup v2 quota file, or one we cannot read: the affinity stands
        limit = cores
    return min(cores, limit)


AUTO_MIN_ROWS = 8  # the automatic lane count leaves each lane room to batch this many sequences


def lane_count(lanes: int, threads: int, max_batch: int) -> int:
    """``engine_lanes``: 0 means one decode thread per ``threads`` usable cores, but no more than leaves each lane
    ``AUTO_MIN_ROWS`` of ``max_batch`` (many one-row lanes would each read every weight per step and batch nothing);
    at least one, and never more than ``max_batch``."""
    if lanes <= 0:
        lanes = min(usable_cores() // max(1, threads), max_batch // AUTO_MIN_ROWS)
    return max(1, min(lanes, max_batch))
