"""The fault drills: a killed INT8 worker (crash), more load than the cap (overload), a long run watched for
memory growth (soak), fuzzed input from the OpenAPI spec (bad-input)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import List

import httpx

from policy_bundle.loadtest.load import (ADMIN, TOKEN, DrillRun, closed_loop, drive, measure_capacity,
                                         open_loop, phase_requests, sample_rss, watch)
from policy_bundle.loadtest.procs import server_processes
from policy_bundle.loadtest.servers import Server
from policy_bundle.loadtest.soak import memory_growth, sample_memory_every
from policy_bundle.loadtest.drill_kit import all_answered, build_bundle, history, start_server
from policy_bundle.quantize.percentile import percentile


def int8_worker_pids(server: Server) -> List[int]:
    """PIDs of the INT8 service's workers inside this server: descendants of its pid whose command
    line is BentoML's worker for ``int8-policy``; a process elsewhere never qualifies, whatever its name."""
    return [p.pid for p in server_processes(server.proc.pid) if p.role == "int8"]


def kill_new_int8_workers(server: Server, killed: List[int]) -> None:
    """SIGKILL each INT8 worker of ``server`` not in ``killed`` yet (the first, or one BentoML restarted), adding it."""
    for pid in int8_worker_pids(server):
        if pid not in killed:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)


def drill_crash(run: DrillRun, home: Path, seconds: float) -> None:
    server = start_server(run, home, build_bundle(home, run.out / "good", broken=False), "server.log", 4.0)
    try:
        pin_weight(server, 100)  # all traffic on INT8: every FP16 answer after the kill is a fail-over

        async def scenario():
            stop = asyncio.Event()
            load = asyncio.create_task(drive(run, server.url, seconds, stop=stop))
            await asyncio.sleep(seconds / 3)
            pids: List[int] = []
            kill_new_int8_workers(server, pids)
            run.crash_t = time.monotonic() - run.t0
            run.marks.append({"t": run.crash_t, "label": "INT8 worker SIGKILLed"})
            # BentoML's watcher restarts a dead worker within seconds: look while it is down. /status shows
            # what the router's probe loop last saw (a killed worker's probe times out after health_timeout_s).
            # A worker back before a health probe's timeout (3 s) is never seen down: its port stays open (the arbiter
            # holds it), so probes and requests just wait (a CI run: back in 3 s, no fail-over). So each
            # restarted worker is killed too until the router reports the variant down.
            degraded = []
            async with httpx.AsyncClient(timeout=10) as client:
                for _ in range(150):
                    degraded.append((await client.get(f"{server.url}/status")).json())
                    if degraded[-1]["variants"]["int8"]["ready"] is False:
                        break
                    kill_new_int8_workers(server, pids)
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
    run.figures["int8_pids_killed"] = pids
    run.check(f"killed the INT8 worker ({len(pids)} process(es) under the server: {pids})", bool(pids))
    run.check("readiness reports the degraded INT8 variant", status["variants"]["int8"]["ready"] is False)
    before = [r for r in run.requests if r["t"] + r["latency"] <= run.crash_t]  # answered before the kill
    after = [r for r in run.requests if r["t"] > run.crash_t]
    fp16_after = sum(r["variant"] == "fp16" for r in after)
    run.check(f"before the crash INT8 answered everything ({len(before)} requests)",
              before and all(r["variant"] == "int8" for r in before))
    run.check(f"every client request after the crash got an answer ({len(after)} requests, {fp16_after} failed over "
              "to FP16 while INT8 was down)", after and all(r["status"] == 200 for r in after) and fp16_after > 0)
    run.check("the rollout history recorded the INT8 failures",
              any(e["event"] in ("variant-down", "variant-errors", "analysis-failed", "rollback")
                  and "int8" in e["reason"] for e in run.history))


# ---- overload --------------------------------------------------------------------------------


LOAD_CAP = 8  # the load drills' closed-loop users: the admission cap's room for clients
BACKGROUND = 2  # the router's background_slots (shadow + golden calls), counted in max_inflight too


def serve_with_cap(run: DrillRun, home: Path) -> Server:
    """A good bundle served with the load drills' admission cap: LOAD_CAP clients + the canary's calls."""
    return start_server(run, home, build_bundle(home, run.out / "good", broken=False), "server.log", 4.0,
                        router={"max_inflight": LOAD_CAP + BACKGROUND, "background_slots": BACKGROUND,
                                "request_timeout_s": 30.0})


def pin_weight(server: Server, weight: float) -> None:
    """Pause the rollout at ``weight`` % INT8."""
    httpx.post(f"{server.url}/admin/rollout", json={"action": "set-weight", "weight": weight}, headers=ADMIN,
               timeout=10).raise_for_status()


def drill_overload(run: DrillRun, home: Path, seconds: float) -> None:
    """Measure capacity with a closed loop at the admission cap's room for clients, offer twice that as open-loop
    arrivals, then drop the load and check the server recovers."""
    cap = LOAD_CAP
    server = serve_with_cap(run, home)
    try:
        pin_weight(server, 50)  # a fixed split: this drill is about load

        async def scenario() -> dict:
            stop = asyncio.Event()
            sampler = asyncio.create_task(sample_rss(run, server, stop))
            capacity = await measure_capacity(run, server.url, cap, max(6.0, seconds * 0.2))
            run.marks.append({"t": time.monotonic() - run.t0, "label": f"offer 2x ({2 * capacity:.0f}/s)"})
            rss_before = max(x["mb"] for x in run.rss)
            await open_loop(run, server.url, "overload", 2 * capacity, max(10.0, seconds * 0.5))
            run.marks.append({"t": time.monotonic() - run.t0, "label": f"load drops ({cap // 2} users)"})
            # Back to 0 once the burst's requests are answered; a shadow or golden call of the canary may
            # still be running for a moment (they count too), so look for up to 20 s: a leak never drains.
            async with httpx.AsyncClient(timeout=10) as client:
                for _ in range(40):
                    await asyncio.sleep(0.5)
                    inflight_after = (await client.get(f"{server.url}/status")).json()["inflight"]
                    if inflight_after == 0:
                        break
            await closed_loop(run, server.url, "recovery", cap // 2, max(6.0, seconds * 0.2))
            stop.set()
            await sampler
            return {"capacity": capacity, "rss_before": rss_before, "inflight_after": inflight_after}

        f = asyncio.run(scenario())
        ready_after = httpx.get(f"{server.url}/readyz", timeout=10).status_code
        run.history = history(server.url)
    finally:
        server.stop()
    base, over, rec = phase_requests(run, "capacity"), phase_requests(run, "overload"), phase_requests(run, "recovery")
    base_lat = [r["latency"] for r in base if r["status"] == 200]
    admitted = [r["latency"] for r in over if r["status"] == 200]
    rejected = [r for r in over if r["status"] != 200]
    over_rss = [x["mb"] for x in run.rss if x["t"] >= over[0]["t"]] if over else [0.0]
    rss_bound = 1.10 * f["rss_before"] + 64
    arrivals_s = max(1e-9, max(r["t"] for r in over) - min(r["t"] for r in over)) if over else 1.0
    run.figures.update({
        "capacity_rps": f["capacity"], "offered_rps": len(over) / arrivals_s,
        "admitted_rps": len(admitted) / arrivals_s, "rejected": len(rejected), "overload_requests": len(over),
        "p50_at_capacity_ms": 1000 * percentile(base_lat, 0.5),
        "p99_at_capacity_ms": 1000 * percentile(base_lat, 0.99),
        "p50_admitted_ms": 1000 * percentile(admitted, 0.5), "p99_admitted_ms": 1000 * percentile(admitted, 0.99),
        "p50_recovery_ms": 1000 * percentile([r["latency"] for r in rec if r["status"] == 200], 0.5),
        "rss_before_mb": f["rss_before"], "rss_peak_overload_mb": max(over_rss), "rss_bound_mb": rss_bound,
        "inflight_after_overload": f["inflight_after"]})
    fig = run.figures
    print(f"[overload] capacity {fig['capacity_rps']:.1f} req/s at {cap} in flight; offered "
          f"{fig['offered_rps']:.1f}/s, admitted {fig['admitted_rps']:.1f}/s, {len(rejected)} of {len(over)} rejected",
          flush=True)
    run.check(f"offered about twice capacity ({fig['offered_rps']:.1f} vs {fig['capacity_rps']:.1f} req/s)",
              1.6 <= fig["offered_rps"] / max(fig["capacity_rps"], 1e-9) <= 2.4)
    run.check(f"excess requests were turned away ({len(rejected)} of {len(over)}), every one with 429/503 and "
              "Retry-After", bool(rejected) and all(r["status"] in (429, 503) and r["retry_after"] for r in rejected))
    # Admitted latency is a figure, not a check (timed assertions on 2 shared cores are noise: the same build
    # measured 2.4x, 3.07x and 4.3x): admission control is asserted by what it does, every request either
    # admitted and answered 200 or turned away with 429/503 + Retry-After (above), never queued until it times out.
    fig["p99_admitted_over_capacity"] = fig["p99_admitted_ms"] / max(fig["p99_at_capacity_ms"], 1e-9)
    print(f"[overload] admitted p99 {fig['p99_admitted_ms']:.0f} ms vs {fig['p99_at_capacity_ms']:.0f} ms at "
          f"capacity ({fig['p99_admitted_over_capacity']:.2f}x)", flush=True)
    run.check(f"some requests were admitted and answered during the overload ({len(admitted)})", bool(admitted))
    run.check(f"memory stayed bounded (peak {fig['rss_peak_overload_mb']:.0f} MB vs {fig['rss_before_mb']:.0f} MB "
              f"before; bound {rss_bound:.0f} MB)", fig["rss_peak_overload_mb"] <= rss_bound)
    run.check(f"nothing leaked: in-flight count back to {fig['inflight_after_overload']} after the burst, "
              f"/readyz {ready_after}", fig["inflight_after_overload"] == 0 and ready_after == 200)
    run.check(f"recovered when load dropped: {len(rec)} requests all 200, p50 {fig['p50_recovery_ms']:.0f} ms "
              f"(at capacity {fig['p50_at_capacity_ms']:.0f} ms)",
              bool(rec) and all(r["status"] == 200 for r in rec))


# ---- soak ------------------------------------------------------------------------------------


def drill_soak(run: DrillRun, home: Path, seconds: float, requests: int = 50_000, max_growth_kb: float = 0.5) -> None:
    """``requests`` at about half the measured capacity (a paced closed loop, 50/50 split), the RSS of every
    server process sampled every few hundred requests; each must grow less than ``max_growth_kb`` per request."""
    every = min(250, max(25, requests // 40))
    server = serve_with_cap(run, home)
    try:
        pin_weight(server, 50)

        async def scenario() -> float:
            capacity = await measure_capacity(run, server.url, LOAD_CAP, 6.0)
            run.marks.append({"t": time.monotonic() - run.t0, "label": f"soak at {capacity / 2:.0f} req/s"})
            done = asyncio.Event()
            sampler = asyncio.create_task(sample_memory_every(run, server.proc.pid, every, done))
            await closed_loop(run, server.url, "soak", LOAD_CAP, seconds, rate=capacity / 2, requests=requests)
            done.set()
            await sampler
            return capacity

        capacity = asyncio.run(scenario())
        run.history = history(server.url)
    finally:
        server.stop()
    soak = phase_requests(run, "soak")
    run.growth = memory_growth(run.memory)
    took = max(r["t"] + r["latency"] for r in soak) - soak[0]["t"] if soak else 0.0
    run.figures.update({"capacity_rps": capacity, "soak_rps": len(soak) / max(took, 1e-9), "soak_requests": len(soak),
                        "soak_seconds": took, "sample_every": every, "max_growth_kb_per_request": max_growth_kb,
                        "memory_growth": {g.label: asdict(g) for g in run.growth}})
    print(f"[soak] {len(soak)} requests in {took:.0f} s ({run.figures['soak_rps']:.1f} req/s, capacity "
          f"{capacity:.1f}); growth after warm-up per process:", flush=True)
    for g in run.growth:
        print(f"[soak]   {g.label:<14} pid {g.pid:<7} {g.first_mb:7.1f} -> {g.last_mb:7.1f} MB, "
              f"{g.mb_per_1000_requests:+.3f} MB per 1000 requests ({g.kb_per_request:+.4f} KB/request)", flush=True)
    run.check(f"served the whole budget: {len(soak)} of {requests} requests within {seconds:.0f} s", len(soak) >= requests)
    run.check("every request got a 200", bool(soak) and all(r["status"] == 200 for r in soak))
    roles = {g.label for g in run.growth}
    run.check(f"sampled every server process ({', '.join(g.label for g in run.growth)})",
              {"arbiter", "router", "int8", "fp16"} <= roles)
    for g in run.growth:  # NaN (too few samples) fails
        run.check(f"{g.label} grew {g.kb_per_request:+.4f} KB/request after warm-up (bound {max_growth_kb} KB)",
                  g.kb_per_request < max_growth_kb)


# ---- bad input -------------------------------------------------------------------------------

FUZZ_CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance",
               "response_schema_conformance", "negative_data_rejection", "allow_header_conformance")


def drill_bad_input(run: DrillRun, home: Path, seconds: float) -> None:
    """Schemathesis against the served OpenAPI spec (``/docs.json``) for a bounded number of cases,
    admin token included, while well-formed users keep sending traffic."""
    import json

    server = start_server(run, home, build_bundle(home, run.out / "good", broken=False), "server.log", 4.0)
    report_dir = run.out / "schemathesis"
    timeout_s = 30
    cmd = [str(Path(sys.executable).parent / "schemathesis"), "run", f"{server.url}/docs.json",
           "--checks", ",".join(FUZZ_CHECKS), "--max-examples", str(max(10, int(seconds))),
           "--request-timeout", str(timeout_s), "--header", f"Authorization: Bearer {TOKEN}", "--seed", "20261130",
           "--report", "junit,har", "--report-dir", str(report_dir), "--generation-database", "none", "--no-color",
           "--max-failures", "50"]
    try:
        async def scenario():
            stop = asyncio.Event()
            load = asyncio.create_task(drive(run, server.url, 10 * seconds, users=3, stop=stop))
            proc = await asyncio.create_subprocess_exec(*cmd, cwd=run.out, stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.STDOUT)
            try:
                out, _ = await asyncio.wait_for(proc.communicate(), timeout=max(300.0, 10 * seconds))
            except asyncio.TimeoutError:
                proc.kill()
                out = b"schemathesis did not finish in time"
            stop.set()
            await load
            return proc.returncode, out.decode(errors="replace")

        rc, output = asyncio.run(scenario())
        ready_after = httpx.get(f"{server.url}/readyz", timeout=10).status_code
        probe = httpx.post(f"{server.url}/v1/completions", json={"model": "policy", "prompt": "12+34=",
                                                                 "max_tokens": 6, "temperature": 0}, timeout=30)
        run.history = history(server.url)
    finally:
        server.stop()
    (run.out / "schemathesis.txt").write_text(output)
    entries = []
    for har in report_dir.glob("har-*.json"):
        entries += json.loads(har.read_text())["log"]["entries"]
    statuses: dict = {}
    for e in entries:
        statuses[e["response"]["status"]] = statuses.get(e["response"]["status"], 0) + 1
    slowest = max((e["time"] for e in entries), default=0.0) / 1000
    summary = [line.strip() for line in output.splitlines() if "generated" in line or "passed" in line]
    run.figures.update({"fuzz_cases": len(entries), "fuzz_statuses": {str(k): v for k, v in sorted(statuses.items())},
                        "fuzz_slowest_s": slowest, "schemathesis_exit": rc, "schemathesis_summary": summary[-3:]})
    print(f"[bad-input] {len(entries)} fuzzed requests, statuses {dict(sorted(statuses.items()))}, "
          f"slowest {slowest:.2f}s; schemathesis exit {rc}", flush=True)
    run.check(f"schemathesis ran {len(entries)} cases against /docs.json and every check passed "
              f"({', '.join(FUZZ_CHECKS)})", rc == 0 and len(entries) >= 50)
    run.check(f"no 5xx among the fuzzed requests (statuses: {dict(sorted(statuses.items()))})",
              bool(entries) and not any(s >= 500 for s in statuses))
    run.check(f"no hang: slowest fuzzed request {slowest:.2f}s (timeout {timeout_s}s)", slowest < timeout_s)
    run.check(f"server still ready ({ready_after}) and answering ({probe.status_code}) after the fuzzing",
              ready_after == 200 and probe.status_code == 200)
    run.check(f"well-formed users were unaffected ({len(run.requests)} requests during the fuzzing, all 200)",
              bool(run.requests) and all_answered(run))
