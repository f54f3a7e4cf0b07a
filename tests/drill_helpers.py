"""The drills' runner for the drill tests: a drill CLI in a fresh process, its passed report, one bundle cache."""

import json
import os
import subprocess
import sys

import pytest

from cli_helpers import ROOT, shared_tmp


@pytest.fixture(scope="module", autouse=True)
def drill_bundles(tmp_path_factory):
    """One good and one broken bundle for every drill of this run, in both workers (built by the first drill
    that needs it, under a lock; copied, verified and registered by the others: see ``build_bundle``)."""
    os.environ["POLICY_BUNDLE_DRILL_BUNDLES"] = str(shared_tmp(tmp_path_factory) / "drill-bundles")
    yield
    del os.environ["POLICY_BUNDLE_DRILL_BUNDLES"]


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
