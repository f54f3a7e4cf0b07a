"""Rollout drills end to end (short budgets): each command builds, serves, drives load and asserts."""

import json
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from cli_helpers import ROOT
from policy_bundle.loadtest.drills import int8_worker_pids
from policy_bundle.loadtest.procs import WORKER_SCRIPT

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


# promote stops as soon as it reaches 100 %: its budget is an upper bound, not its duration
@pytest.mark.parametrize("drill,seconds", [("promote", 120), ("bad-build", 40), ("restart", 40), ("crash", 40),
                                           ("overload", 40), ("bad-input", 40)])
def test_drill_command_passes_and_writes_its_report(drill, seconds, tmp_path, reference_dir):
    res = subprocess.run([sys.executable, "-m", "policy_bundle.loadtest.drills", drill, "--seconds", str(seconds), "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = tmp_path / drill
    figures = json.loads((out / "report.json").read_text())
    assert figures["passed"] and figures["requests"] > 0
    for png in ("traffic.png", "latency.png", "canary.png"):
        assert (out / png).stat().st_size > 0
    assert "PASSED" in (out / "report.md").read_text()
    if drill == "overload":  # the offered load, what was turned away and the memory are in the report
        assert figures["figures"]["rejected"] > 0 and figures["rss"] and (out / "load.png").stat().st_size > 0
    if drill == "bad-input":
        assert figures["figures"]["fuzz_cases"] >= 50 and not any(int(s) >= 500 for s in figures["figures"]["fuzz_statuses"])


def test_int8_worker_pids_are_only_workers_inside_the_server():
    """A process named like the INT8 worker outside the server's process tree is never picked."""
    worker = ["-m", WORKER_SCRIPT, "policy_bundle.serve.service:PolicyRouter", "--service-name", "int8-policy"]
    decoy = subprocess.Popen(SLEEPER + ["int8-policy", *worker])  # not a descendant of the "server"
    server = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run(sys.argv[1:])",
                               *SLEEPER, *worker])  # its child has the INT8 worker's command line
    try:
        deadline = time.monotonic() + 30
        while not (pids := int8_worker_pids(SimpleNamespace(proc=server))) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(pids) == 1 and pids[0] not in (decoy.pid, server.pid)
    finally:
        for p in (decoy, server):
            p.kill()
            p.wait()
