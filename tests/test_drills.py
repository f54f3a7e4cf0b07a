"""Rollout drills end to end (short budgets): each command builds, serves, drives load and asserts."""

import json
import subprocess
import sys

import pytest

from cli_helpers import ROOT


@pytest.mark.parametrize("drill", ["bad-build", "restart", "crash"])
def test_drill_command_passes_and_writes_its_report(drill, tmp_path, reference_dir):
    res = subprocess.run([sys.executable, "-m", "loadtest.drills", drill, "--seconds", "40", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = tmp_path / drill
    figures = json.loads((out / "report.json").read_text())
    assert figures["passed"] and figures["requests"] > 0
    for png in ("traffic.png", "latency.png", "canary.png"):
        assert (out / png).stat().st_size > 0
    assert "PASSED" in (out / "report.md").read_text()
