"""Rollout drills: build what is needed, serve it, drive load, assert the outcome, write a report.

    .venv/bin/python -m policy_bundle.loadtest.drills promote|bad-build|restart|crash|overload|bad-input|soak|stall|replicas
        [--seconds N] [--out DIR] [--fp16-engine vllm|fallback] [--requests N] [--max-growth-kb KB]

Each drill uses its own BentoML home and state dir under ``--out`` (default ``.cache/drills``),
sends traffic only to the loopback server it started, and stops by itself. The load (``loadtest/load.py``) is an
asyncio loop of users with stable ids (not Locust) because the report needs the variant of every
single request; ``loadtest/locustfile.py`` is the Locust scenario for open-ended load.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import time
from pathlib import Path
from typing import List, Optional

import httpx

from policy_bundle.loadtest.load import ADMIN, TOKEN, DrillRun, load_and_watch
from policy_bundle.loadtest.servers import ROOT
from policy_bundle.loadtest.drill_faults import (BACKGROUND, LOAD_CAP, drill_bad_input, drill_crash, drill_overload,
                                                 drill_soak, pin_weight)
from policy_bundle.loadtest.drill_kit import all_answered, build_bundle, history, start_server
from policy_bundle.quantize.runtime.vllm_launch import vllm_available


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
    run.check("INT8 promoted from 1 % to 100 % through every step", state.get("status") == "promoted"
              and [e["to_weight"] for e in run.history if e["event"] == "promote"] == [5.0, 25.0, 50.0, 100.0])
    failed = [f"{e['event']}: {e.get('reason', '')}" for e in run.history if e["event"] in ("analysis-failed", "rollback")]
    run.check("no analysis failed and no rollback" + (f" ({' | '.join(failed)})" if failed else ""), not failed)
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


def drill_stall(run: DrillRun, home: Path, seconds: float, requests: int = 1000) -> None:
    """Streams while INT8 stalls past request_timeout_s and FP16 mid-stream, then hang-ups before the first
    byte (``loadtest/stall_drill.py``): no 5xx, in-flight back to 0 after each."""
    from policy_bundle.loadtest import stall_drill

    version = build_bundle(home, run.out / "good", broken=False)
    server = start_server(run, home, version, "server.log", 3600.0, fault=stall_drill.STALL, router={
        "max_inflight": LOAD_CAP + BACKGROUND, "background_slots": BACKGROUND,
        "request_timeout_s": stall_drill.TIMEOUT_S})
    try:
        pin_weight(server, 50)
        stall_drill.run_stall(run, server, requests, TOKEN)
        run.history = history(server.url)
    finally:
        server.stop()


DRILLS = {"promote": drill_promote, "bad-build": drill_bad_build, "restart": drill_restart, "crash": drill_crash,
          "overload": drill_overload, "bad-input": drill_bad_input, "soak": drill_soak, "stall": drill_stall,
          "replicas": None}


def default_fp16_engine() -> str:
    return "vllm" if vllm_available(honour_switch=False) else "fallback"


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="Run a rollout drill against a freshly served bundle.")
    ap.add_argument("drill", choices=sorted(DRILLS))
    ap.add_argument("--seconds", type=float, default=None,
                    help="load budget (the drill stops by itself); default 90, for soak an upper bound of 3600")
    ap.add_argument("--requests", type=int, default=None, help="soak: requests to serve (default 50000); stall: "
                    "streams (default 1000); replicas: at least this many (default 5000)")
    ap.add_argument("--max-growth-kb", type=float, default=0.5, help="soak: allowed RSS growth per request, per process")
    ap.add_argument("--out", type=Path, default=ROOT / ".cache" / "drills")
    ap.add_argument("--fp16-engine", choices=("vllm", "fallback"), default=default_fp16_engine(),
                    help="what serves the FP16 variant: vLLM (the default when it is importable) or our policy module")
    args = ap.parse_args(argv)
    out = args.out / args.drill
    shutil.rmtree(out, ignore_errors=True)  # a drill starts from no rollout state and no old report
    out.mkdir(parents=True)
    run = DrillRun(args.drill, out, fp16_engine=args.fp16_engine)
    if args.drill == "soak":
        drill_soak(run, args.out / "home", args.seconds or 3600.0, args.requests or 50_000, args.max_growth_kb)
    elif args.drill == "stall":
        drill_stall(run, args.out / "home", 0.0, args.requests or 1000)
    elif args.drill == "replicas":
        from policy_bundle.loadtest.drill_replicas import drill_replicas

        drill_replicas(run, args.out / "home", args.seconds or 900.0, args.requests or 5000, build_bundle, start_server)
    else:
        DRILLS[args.drill](run, args.out / "home", args.seconds or 90.0)
    from policy_bundle.loadtest.report import write_report

    report = write_report(run)
    print(f"[{run.name}] {'PASSED' if run.passed else 'FAILED'}: {sum(ok for _, ok in run.checks)}/{len(run.checks)} "
          f"checks, {len(run.requests)} requests; report {report}")
    return 0 if run.passed else 1


if __name__ == "__main__":
    sys.exit(main())
