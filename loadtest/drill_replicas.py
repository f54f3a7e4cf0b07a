"""The replicas drill: two router processes on one PostgreSQL rollout database under load, first a good build
(promoted through every step), then a broken one (rolled back), every request sent to one of the two.

Checks: every request answered; each pair's history has one transition per state version (no gap, none
twice) and each transition starts at the weight the one before it ended (nothing contradictory); both
replicas end at the same state version within a few sync ticks; the good pair promoted, the broken pair rolled
back and never promoted after it.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import List

import httpx

from policy_bundle.loadtest.load import ADMIN, DrillRun, drive
from policy_bundle.loadtest.postgres import PostgresServer, fresh_root


def transitions_consistent(history: List[dict]) -> tuple:
    """(versions contiguous from 1 and unique, each transition starts where the previous ended)."""
    moves = [e for e in history if e["state_version"] is not None]
    versions = [e["state_version"] for e in moves]
    contiguous = versions == list(range(1, len(versions) + 1))
    chained = all(b["from_weight"] == a["to_weight"] for a, b in zip(moves, moves[1:]))
    return contiguous, chained


async def _phase(run: DrillRun, urls: List[str], until: str, requests: int, seconds: float) -> dict:
    """Load on every replica until the rollout reaches ``until`` and ``requests`` more were sent (or time ends)."""
    stop, start, deadline = asyncio.Event(), len(run.requests), time.monotonic() + seconds
    loads = [asyncio.create_task(drive(run, url, seconds, users=4, stop=stop)) for url in urls]
    state: dict = {}
    async with httpx.AsyncClient(timeout=10) as client:
        while time.monotonic() < deadline:
            await asyncio.sleep(1.0)
            try:
                state = (await client.get(f"{urls[0]}/admin/rollout", headers=ADMIN)).json()["state"]
            except (httpx.HTTPError, KeyError, ValueError):
                continue
            run.states.append({"t": time.monotonic() - run.t0, "weight": state["weight"], "status": state["status"]})
            if state["status"] == until and len(run.requests) - start >= requests:
                break
    stop.set()
    await asyncio.gather(*loads)
    return state


CONVERGE_S = 5.0  # a replica re-reads the shared state every sync_interval_s (1 s by default)


def _same(got: List[dict]) -> bool:
    return len({g["state_version"] for g in got}) == 1 and len({g["pair"]["label"] for g in got}) == 1


def _converged(urls: List[str]) -> tuple:
    """Each replica's /admin/rollout once they agree (or at the deadline), and the seconds that took: the last
    transition lands on one replica, the other adopts it at its next sync tick."""
    t0 = time.monotonic()
    while True:
        got = [httpx.get(f"{url}/admin/rollout", headers=ADMIN, timeout=10).json() for url in urls]
        waited = time.monotonic() - t0
        if _same(got) or waited >= CONVERGE_S:
            return got, waited
        time.sleep(0.2)


def drill_replicas(run: DrillRun, home: Path, seconds: float, requests: int, build_bundle, start_server) -> None:
    db = PostgresServer(fresh_root()).start()
    run.figures["state_url"] = db.url
    try:
        for name, broken, until in (("good", False, "promoted"), ("broken", True, "rolled-back")):
            version = build_bundle(home, run.out / name, broken=broken)
            run.marks.append({"t": time.monotonic() - run.t0, "label": f"{name} build"})
            servers = [start_server(run, home, version, f"{name}-{i}.log", 4.0, router={"state_url": db.url})
                       for i in range(2)]
            try:
                before = len(run.requests)
                state = asyncio.run(_phase(run, [s.url for s in servers], until, requests // 2, seconds))
                got, converged = _converged([s.url for s in servers])
                history = httpx.get(f"{servers[1].url}/admin/rollout/history?limit=10000", headers=ADMIN,
                                    timeout=30).json()["history"]
            finally:
                for s in servers:
                    s.stop()
            run.history += [{**e, "pair": name} for e in history]
            served = run.requests[before:]
            contiguous, chained = transitions_consistent(history)
            run.check(f"{name}: the rollout reached {until} ({state.get('status')}, {state.get('weight')} %)",
                      state.get("status") == until)
            run.check(f"{name}: {len(served)} requests over both replicas, all 200",
                      bool(served) and all(r["status"] == 200 for r in served))
            run.check(f"{name}: one transition per state version, no gap and none twice ({len(history)} events)",
                      contiguous)
            run.check(f"{name}: every transition starts at the weight the previous one ended", chained)
            run.check(f"{name}: both replicas at the same state version within {CONVERGE_S:.0f} s "
                      f"({[g['state_version'] for g in got]}, after {converged:.1f} s)", _same(got))
            if broken:
                events = [e["event"] for e in history]
                after = events[events.index("rollback"):] if "rollback" in events else ["no rollback"]
                run.check("broken: nothing promoted after the rollback", "promote" not in after and after[0] == "rollback")
        run.check(f"at least {requests} requests in all ({len(run.requests)})", len(run.requests) >= requests)
    finally:
        db.remove()
