"""Load for the drills: the run record, closed- and open-loop users, rollout-state polling and the
server's memory. Users have stable ids (sticky routing applies) and every request is recorded with
its variant, status and latency, which is what the drill reports plot."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import httpx

from policy_bundle.loadtest.procs import tree_rss_mb
from policy_bundle.loadtest.servers import Server
from policy_bundle.quantize.reference.task import rollout_prompts

TOKEN = "drill-admin-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


@dataclass
class DrillRun:
    name: str
    out: Path
    fp16_engine: str = "fallback"  # vllm | fallback: what serves the FP16 variant
    requests: List[dict] = field(default_factory=list)  # t, variant, status, latency
    states: List[dict] = field(default_factory=list)  # t, weight, status
    history: List[dict] = field(default_factory=list)
    checks: List[tuple] = field(default_factory=list)
    rss: List[dict] = field(default_factory=list)  # t, mb (server process tree)
    marks: List[dict] = field(default_factory=list)  # t, label: phase changes drawn on the plots
    memory: List[dict] = field(default_factory=list)  # t, requests, label, pid, mb: per server process (soak)
    growth: list = field(default_factory=list)  # soak.Growth per server process
    figures: dict = field(default_factory=dict)  # drill-specific numbers for report.json / report.md
    t0: float = field(default_factory=time.monotonic)

    def check(self, what: str, ok: bool) -> None:
        self.checks.append((what, bool(ok)))
        print(f"[{self.name}] {'PASS' if ok else 'FAIL'}: {what}", flush=True)

    @property
    def passed(self) -> bool:
        return all(ok for _, ok in self.checks)


async def drive(run: DrillRun, url: str, seconds: float, users: int = 6, stop: Optional[asyncio.Event] = None) -> None:
    """Users with stable ids send completions until ``seconds`` pass; every request is recorded."""
    prompts = rollout_prompts(256)
    deadline = time.monotonic() + seconds

    async def user(i: int, client: httpx.AsyncClient) -> None:
        rng = random.Random(i)
        while time.monotonic() < deadline and not (stop and stop.is_set()):
            body = {"model": "policy", "prompt": rng.choice(prompts), "max_tokens": 6, "temperature": 0,
                    "user": f"drill-user-{i}-{rng.randrange(20)}"}
            t = time.monotonic()
            try:
                r = await client.post(f"{url}/v1/completions", json=body)
                status, variant = r.status_code, r.headers.get("x-policy-variant")
            except httpx.HTTPError as exc:
                status, variant = f"error: {type(exc).__name__}", None
            run.requests.append({"t": t - run.t0, "variant": variant, "status": status, "latency": time.monotonic() - t})
            await asyncio.sleep(rng.uniform(0.02, 0.1))

    async with httpx.AsyncClient(timeout=60) as client:
        await asyncio.gather(*[user(i, client) for i in range(users)])


async def watch(run: DrillRun, url: str, seconds: float, until: Optional[str] = None) -> dict:
    """Poll the rollout state once a second; stop early when its status becomes ``until``."""
    deadline = time.monotonic() + seconds
    state: dict = {}
    async with httpx.AsyncClient(timeout=10) as client:
        while time.monotonic() < deadline:
            try:
                state = (await client.get(f"{url}/admin/rollout", headers=ADMIN)).json()["state"]
                run.states.append({"t": time.monotonic() - run.t0, "weight": state["weight"], "status": state["status"]})
            except (httpx.HTTPError, KeyError, ValueError) as exc:  # a busy or restarting router: poll again
                print(f"[{run.name}] state poll failed: {type(exc).__name__}", flush=True)
            if until and state.get("status") == until:
                break
            await asyncio.sleep(1.0)
    return state


async def load_and_watch(run: DrillRun, url: str, seconds: float, until: Optional[str]) -> dict:
    stop = asyncio.Event()
    load = asyncio.create_task(drive(run, url, seconds, stop=stop))
    state = await watch(run, url, seconds, until)
    stop.set()
    await load
    return state


async def sample_rss(run: DrillRun, server: Server, stop: asyncio.Event) -> None:
    while not stop.is_set():
        run.rss.append({"t": time.monotonic() - run.t0, "mb": tree_rss_mb(server.proc.pid)})
        await asyncio.sleep(0.5)


def body_for(rng: random.Random, prompts: List[str], i: int) -> dict:
    return {"model": "policy", "prompt": rng.choice(prompts), "max_tokens": 6, "temperature": 0,
            "user": f"overload-user-{i % 50}"}


async def post(run: DrillRun, session, url: str, phase: str, body: dict) -> None:
    """One request, recorded. aiohttp rather than httpx here: the load generator shares the CPU with
    the server, and aiohttp costs a fraction of httpx per request, so more of the offered load is real."""
    import aiohttp

    t = time.monotonic()
    try:
        async with session.post(f"{url}/v1/completions", json=body) as r:
            await r.read()
            status, variant, retry_after = r.status, r.headers.get("x-policy-variant"), r.headers.get("retry-after")
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        status, variant, retry_after = f"error: {type(exc).__name__}", None, None
    run.requests.append({"t": t - run.t0, "phase": phase, "latency": time.monotonic() - t, "status": status,
                         "variant": variant, "retry_after": retry_after})


def session():
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1000),
                                 timeout=aiohttp.ClientTimeout(total=60))


async def closed_loop(run: DrillRun, url: str, phase: str, clients: int, seconds: float, rate: float = 0.0,
                      requests: int = 0) -> None:
    """``clients`` users, each sending its next request as soon as the last one is answered or, with
    ``rate`` (requests/s for all users together), at its next turn after that (never in a burst to catch
    up); stops after ``seconds`` or, with ``requests``, once that many have been sent."""
    prompts, deadline, sent = rollout_prompts(256), time.monotonic() + seconds, 0
    async with session() as s:
        async def user(i: int) -> None:
            nonlocal sent
            rng, due = random.Random(i), time.monotonic() + (i / rate if rate else 0.0)
            while time.monotonic() < deadline and not (requests and sent >= requests):
                sent += 1
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                await post(run, s, url, phase, body_for(rng, prompts, i))
                due = max(due + (clients / rate if rate else 0.0), time.monotonic())
        await asyncio.gather(*[user(i) for i in range(clients)])


def phase_requests(run: DrillRun, phase: str) -> List[dict]:
    return [r for r in run.requests if r.get("phase") == phase]


async def measure_capacity(run: DrillRun, url: str, clients: int, seconds: float) -> float:
    """Answered requests/s of a closed loop of ``clients`` users, after a 3 s warm-up."""
    await closed_loop(run, url, "warm-up", clients, 3)
    await closed_loop(run, url, "capacity", clients, seconds)
    return sum(r["status"] == 200 for r in phase_requests(run, "capacity")) / seconds


async def open_loop(run: DrillRun, url: str, phase: str, rate: float, seconds: float) -> None:
    """Poisson arrivals at ``rate`` requests/s whatever the server does (offered load, not a closed loop)."""
    prompts, rng = rollout_prompts(256), random.Random(7)
    deadline, tasks = time.monotonic() + seconds, []
    async with session() as s:
        i, due = 0, time.monotonic()
        while due < deadline:  # an absolute schedule: a late loop catches up instead of offering less
            tasks.append(asyncio.create_task(post(run, s, url, phase, body_for(rng, prompts, i))))
            i += 1
            due += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, due - time.monotonic()))
        await asyncio.gather(*tasks)
