"""Rollout drills end to end (short budgets): each command builds, serves, drives load and asserts."""

import json
import subprocess
import sys

import pytest

from cli_helpers import ROOT


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
