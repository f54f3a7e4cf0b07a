"""Rollout drills: build what is needed, serve it, drive load, assert the outcome, write a report.

    .venv/bin/python -m loadtest.drills promote|bad-build|restart|crash [--seconds N] [--out DIR]

Each drill uses its own BentoML home and state dir under ``--out`` (default ``.cache/drills``),
sends traffic only to the loopback server it started, and stops by itself. The load driver is an
asyncio loop of users with stable ids (not Locust) because the report needs the variant of every
single request; ``loadtest/locustfile.py`` is the Locust scenario for open-ended load.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import httpx
import yaml

from loadtest.servers import ROOT, Server
from quantize.task import rollout_prompts

TOKEN = "drill-admin-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
SMALL = ["--set", "calibration.samples=64", "--set", "calibration.batch_size=16", "--set", "calibration.golden=64",
         "--set", "calibration.procs=0", "--set", "export.onnx=false"]


@dataclass
class DrillRun:
    name: str
    out: Path
    requests: List[dict] = field(default_factory=list)  # t, variant, status, latency
    states: List[dict] = field(default_factory=list)  # t, weight, status
    history: List[dict] = field(default_factory=list)
    checks: List[tuple] = field(default_factory=list)
    t0: float = field(default_factory=time.monotonic)

    def check(self, what: str, ok: bool) -> None:
        self.checks.append((what, bool(ok)))
        print(f"[{self.name}] {'PASS' if ok else 'FAIL'}: {what}", flush=True)

    @property
    def passed(self) -> bool:
        return all(ok for _, ok in self.checks)


def build_bundle(home: Path, out: Path, broken: bool) -> str:
    """A small reference bundle registered in ``home``; returns its store version."""
    from build.manifest import manifest_hash

    env = {**os.environ, "BENTOML_HOME": str(home)}
    args = [sys.executable, "-m", "build.cli", "build", "--config", "build/configs/reference.yaml", "--out", str(out),
            "--force", *SMALL, "--set", f"name={'broken' if broken else 'good'}"]
    if broken:  # a deliberately broken INT8 policy that a gated build would refuse: gate off, one scale x400
        args += ["--set", "canary.enabled=false"]
        env["POLICY_BUNDLE_TEST_FAULT"] = "scale:layer=layers.0.mlp.down_proj:factor=400"
    res = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"bundle build failed:\n{res.stderr[-3000:]}")
    return f"{'broken' if broken else 'good'}-{manifest_hash(out)[:12]}"


def start_server(run: DrillRun, home: Path, version: str, log_name: str, interval: float) -> Server:
    cfg = run.out / "router.yaml"
    cfg.write_text(yaml.safe_dump({"rollout": {"analysis_interval_s": interval, "golden_interval_s": interval * 0.8,
                                               "min_samples": 8, "failure_limit": 2, "golden_items": 16,
                                               "shadow_fraction": 0.3,
                                               # 4 s windows on a shared 2-core box: p99 is noise here
                                               "max_p99_latency_ratio": 10.0}}))
    env = {"BENTOML_HOME": str(home), "POLICY_BUNDLE_VERSION": version, "POLICY_BUNDLE_ADMIN_TOKEN": TOKEN,
           "POLICY_BUNDLE_STATE_DIR": str(run.out / "state"), "POLICY_ROUTER_CONFIG": str(cfg),
           "POLICY_BUNDLE_DISABLE_VLLM": os.environ.get("POLICY_BUNDLE_DISABLE_VLLM", "1"),
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    server = Server(env, run.out / log_name).wait_ready(300)
    if not run.requests and not run.states:  # the drill's clock starts when traffic can start
        run.t0 = time.monotonic()
    return server


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


def history(url: str) -> List[dict]:
    return httpx.get(f"{url}/admin/rollout/history", headers=ADMIN, timeout=10).json()["history"]


def all_answered(run: DrillRun, since: float = 0.0) -> bool:
    return all(r["status"] == 200 for r in run.requests if r["t"] >= since)


# ---- the drills ------------------------------------------------------------------------------


def serve_until(run: DrillRun, home: Path, broken: bool, seconds: float, until: str) -> dict:
    """Build and serve a bundle, drive load until the rollout reaches ``until`` (or time runs out),
    keep its history; returns the last rollout state."""
    bundle = run.out / ("broken" if broken else "good")
    server = start_server(run, home, build_bundle(home, bundle, broken=broken), "server.log", 4.0)
    try:
        state = asyncio.run(load_and_watch(run, server.url, seconds, until=until))
        run.history = history(server.url)
    finally:
        server.stop()
    return state


def drill_promote(run: DrillRun, home: Path, seconds: float) -> None:
    state = serve_until(run, home, broken=False, seconds=seconds, until="promoted")
    events = [e["event"] for e in run.history]
    run.check("INT8 promoted from 1 % to 100 % through every step", state.get("status") == "promoted"
              and [e["to_weight"] for e in run.history if e["event"] == "promote"] == [5.0, 25.0, 50.0, 100.0])
    run.check("no analysis failed and no rollback", "analysis-failed" not in events and "rollback" not in events)
    run.check("every client request got a 200", all_answered(run))


def drill_bad_build(run: DrillRun, home: Path, seconds: float) -> None:
    state = serve_until(run, home, broken=True, seconds=seconds, until="rolled-back")
    failed = [e for e in run.history if e["event"] in ("analysis-failed", "rollback")]
    run.check("the broken INT8 bundle was rolled back to 0 %", state.get("status") == "rolled-back"
              and state.get("weight") == 0.0)
    run.check("rolled back within failure_limit (2) failed analyses", len(failed) <= 2)
    run.check("no client request failed", all_answered(run))


def drill_restart(run: DrillRun, home: Path, seconds: float) -> None:
    version = build_bundle(home, run.out / "good", broken=False)
    server = start_server(run, home, version, "server.log", 4.0)
    try:
        asyncio.run(load_and_watch(run, server.url, seconds / 2, until=None))
        before_state = httpx.get(f"{server.url}/admin/rollout", headers=ADMIN).json()["state"]
        before = history(server.url)
    finally:
        server.stop()
    restart_t = time.monotonic() - run.t0
    server = start_server(run, home, version, "server-restarted.log", 4.0)
    try:
        after_state = httpx.get(f"{server.url}/admin/rollout", headers=ADMIN).json()["state"]
        after_history_at_start = history(server.url)
        asyncio.run(load_and_watch(run, server.url, seconds / 2, until=None))
        run.history = history(server.url)
    finally:
        server.stop()
    keys = ("weight", "step_index", "status")
    run.check(f"router resumed at weight {before_state['weight']} % ({before_state['status']})",
              {k: after_state[k] for k in keys} == {k: before_state[k] for k in keys})
    run.check(f"no history lost across the restart ({len(before)} events kept)",
              after_history_at_start[: len(before)] == before and run.history[: len(before)] == before)
    run.check(f"every request got a 200 (router down between {restart_t:.0f}s and its restart)", all_answered(run))


def int8_worker_pids(server: Server) -> List[int]:
    """PIDs of the INT8 service's worker processes under this server (from /proc)."""
    pids = []
    for cmd in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmd.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "int8-policy" in text or ("Int8Policy" in text and "serve.variants" in text):
            pids.append(int(cmd.parent.name))
    return pids


def drill_crash(run: DrillRun, home: Path, seconds: float) -> None:
    server = start_server(run, home, build_bundle(home, run.out / "good", broken=False), "server.log", 4.0)
    try:
        httpx.post(f"{server.url}/admin/rollout", json={"action": "set-weight", "weight": 50}, headers=ADMIN)
        httpx.post(f"{server.url}/admin/rollout", json={"action": "resume"}, headers=ADMIN)

        async def scenario():
            stop = asyncio.Event()
            load = asyncio.create_task(drive(run, server.url, seconds, stop=stop))
            await asyncio.sleep(seconds / 3)
            pids = int8_worker_pids(server)
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            run.crash_t = time.monotonic() - run.t0
            # BentoML's watcher restarts a dead worker within seconds: look while it is down.
            degraded = []
            async with httpx.AsyncClient(timeout=10) as client:
                for _ in range(20):
                    degraded.append((await client.get(f"{server.url}/status")).json())
                    if degraded[-1]["variants"]["int8"]["ready"] is False:
                        break
                    await asyncio.sleep(0.1)
            status = degraded[-1]
            state = await watch(run, server.url, seconds / 2, until="rolled-back")
            stop.set()
            await load
            return pids, status, state

        pids, status, state = asyncio.run(scenario())
        run.history = history(server.url)
    finally:
        server.stop()
    run.check(f"killed the INT8 worker ({len(pids)} process(es))", bool(pids))
    run.check("readiness reports the degraded INT8 variant", status["variants"]["int8"]["ready"] is False)
    after = [r for r in run.requests if r["t"] > run.crash_t]
    fp16_after = sum(r["variant"] == "fp16" for r in after)
    run.check(f"every client request after the crash got an answer ({len(after)} requests, {fp16_after} from FP16; "
              "the rest waited for BentoML to restart the INT8 worker)", after and all(r["status"] == 200 for r in after))
    run.check("the rollout history recorded the INT8 failures",
              any(e["event"] in ("variant-down", "variant-errors", "analysis-failed", "rollback")
                  and "int8" in e["reason"] for e in run.history))


DRILLS = {"promote": drill_promote, "bad-build": drill_bad_build, "restart": drill_restart, "crash": drill_crash}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="Run a rollout drill against a freshly served bundle.")
    ap.add_argument("drill", choices=sorted(DRILLS))
    ap.add_argument("--seconds", type=float, default=90.0, help="load budget (the drill stops by itself)")
    ap.add_argument("--out", type=Path, default=ROOT / ".cache" / "drills")
    args = ap.parse_args(argv)
    out = args.out / args.drill
    shutil.rmtree(out, ignore_errors=True)  # a drill starts from no rollout state and no old report
    out.mkdir(parents=True)
    run = DrillRun(args.drill, out)
    DRILLS[args.drill](run, args.out / "home", args.seconds)
    from loadtest.report import write_report

    report = write_report(run)
    print(f"[{run.name}] {'PASSED' if run.passed else 'FAILED'}: {sum(ok for _, ok in run.checks)}/{len(run.checks)} "
          f"checks, {len(run.requests)} requests; report {report}")
    return 0 if run.passed else 1


if __name__ == "__main__":
    sys.exit(main())
