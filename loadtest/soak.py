"""Memory over a long run (the soak drill): the RSS of every server process sampled every few hundred
requests, and each process's growth per request after warm-up, from a least-squares line."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass
from typing import Dict, List

import numpy as np

from policy_bundle.loadtest.load import DrillRun
from policy_bundle.loadtest.procs import server_processes

WARM_UP = 0.2  # the first 20 % of the samples are warm-up (allocator arenas, caches filling): not fitted


@dataclass(frozen=True)
class Growth:
    label: str  # the process's role (arbiter, router, int8, fp16, ...); role-pid when a role has several
    pid: int
    first_mb: float
    last_mb: float
    kb_per_request: float  # slope of the line fitted to the samples after warm-up; NaN with under 3
    samples: int

    @property
    def mb_per_1000_requests(self) -> float:
        return self.kb_per_request * 1000 / 1024


def sample_memory(run: DrillRun, root_pid: int, served: int) -> None:
    """One RSS sample of every process of the server, tagged with the requests served so far."""
    procs = server_processes(root_pid)
    per_role = Counter(p.role for p in procs)
    t = time.monotonic() - run.t0
    for p in procs:
        label = p.role if per_role[p.role] == 1 else f"{p.role}-{p.pid}"
        run.memory.append({"t": t, "requests": served, "label": label, "pid": p.pid, "mb": p.rss_mb})


async def sample_memory_every(run: DrillRun, root_pid: int, every: int, done: asyncio.Event) -> None:
    """Sample every ``every`` requests recorded from now on, and once more when ``done`` is set."""
    start, mark = len(run.requests), 0
    while not done.is_set():
        if len(run.requests) - start >= mark:
            sample_memory(run, root_pid, len(run.requests) - start)
            mark += every
        await asyncio.sleep(0.05)
    sample_memory(run, root_pid, len(run.requests) - start)


def memory_growth(samples: List[dict]) -> List[Growth]:
    """Per process: MB at the first and last sample, and KB per request fitted over the last 80 %."""
    by_label: Dict[str, List[dict]] = {}
    for s in samples:
        by_label.setdefault(s["label"], []).append(s)
    growth = []
    for label, rows in by_label.items():
        rows.sort(key=lambda s: s["requests"])
        tail = rows[int(len(rows) * WARM_UP):]
        x, y = np.array([s["requests"] for s in tail], float), np.array([s["mb"] for s in tail], float)
        slope = float(np.polyfit(x, y, 1)[0]) * 1024 if len(tail) >= 3 and np.ptp(x) > 0 else float("nan")
        growth.append(Growth(label, rows[-1]["pid"], rows[0]["mb"], rows[-1]["mb"], slope, len(rows)))
    return growth
