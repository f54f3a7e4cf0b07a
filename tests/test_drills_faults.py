"""Fault drills end to end (short budgets): stalls and hang-ups, overload, fuzzed input, a killed INT8 worker, a
short soak; each command builds (or copies the cached bundle), serves, drives load and asserts."""

import math
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from drill_helpers import drill_bundles, passed_report, run_drill  # noqa: F401 (drill_bundles: an autouse fixture)
from policy_bundle.loadtest.drill_faults import int8_worker_pids
from policy_bundle.loadtest.procs import WORKER_SCRIPT

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


@pytest.mark.parametrize("drill", ["overload", "bad-input"])
def test_fault_drill_command_passes_and_writes_its_report(drill, tmp_path, reference_dir):
    # overload at 24 s: 6 s measuring capacity, 12 s offered twice that, 6 s of recovery (the drill's floors);
    # bad-input: 25 fuzz examples per check and operation (the report asserts at least 50 cases in all)
    seconds = {"overload": "24", "bad-input": "25"}[drill]
    figures = passed_report(run_drill(drill, tmp_path, "--seconds", seconds, "--fp16-engine", "fallback"),
                            tmp_path / drill)
    assert figures["figures"]["fp16_engine"] == "policy-module-fp32"
    if drill == "overload":  # the offered load, what was turned away and the memory are in the report
        assert figures["figures"]["rejected"] > 0 and figures["rss"] and (tmp_path / drill / "load.png").stat().st_size > 0
    if drill == "bad-input":
        assert figures["figures"]["fuzz_cases"] >= 50 and not any(int(s) >= 500 for s in figures["figures"]["fuzz_statuses"])


def test_stall_drill_leaves_nothing_in_flight(tmp_path, reference_dir):
    """Streams while INT8 stalls past request_timeout_s, then hang-ups before the first byte (short run)."""
    figures = passed_report(run_drill("stall", tmp_path, "--requests", "120", "--fp16-engine", "fallback"),
                            tmp_path / "stall")["figures"]
    assert figures["streams"] >= 120 and not any(s.startswith("5") for s in figures["statuses"])
    assert figures["inflight_after_streams"] == 0 and figures["inflight_after_hang_ups"] == 0


def test_int8_worker_pids_are_only_workers_inside_the_server():
    """A process named like the INT8 worker outside the server's process tree is never picked."""
    worker = ["-m", WORKER_SCRIPT, "policy_bundle.serve.router.service:PolicyRouter", "--service-name", "int8-policy"]
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
    decoy = subprocess.Popen(SLEEPER + ["int8-policy", "Int8Policy", "serve.variants.services"])
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
    res = run_drill("soak", tmp_path, "--requests", "600", "--seconds", "120", "--fp16-engine", "fallback",
                    "--max-growth-kb", "1000")
    figures = passed_report(res, tmp_path / "soak")
    growth = figures["figures"]["memory_growth"]
    assert set(growth) >= {"arbiter", "router", "int8", "fp16"}
    assert all(math.isfinite(g["kb_per_request"]) for g in growth.values())
    assert figures["figures"]["soak_requests"] >= 600 and (tmp_path / "soak" / "memory.png").stat().st_size > 0
    assert "KB per request" in (tmp_path / "soak" / "report.md").read_text()
