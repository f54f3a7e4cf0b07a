"""The drills' runner for the drill tests: a drill CLI in a fresh process, its passed report, one bundle cache."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from filelock import FileLock

from cli_helpers import ROOT, shared_tmp


@pytest.fixture(scope="module", autouse=True)
def drill_bundles(tmp_path_factory, small_bundle):
    """One good and one broken bundle for every drill of this run, in both workers: the good one is the suite's
    small bundle (the same reference config the drills build; one build fewer), the broken one is built by the
    first drill that needs it, under a lock. The drills copy, verify and register them: see ``build_bundle``."""
    cache = shared_tmp(tmp_path_factory) / "drill-bundles"
    cache.mkdir(exist_ok=True)
    with FileLock(str(cache / "good.lock")):  # build_bundle's lock for the good bundle
        if not (cache / "good" / "bundle.json").is_file():
            tmp = cache / f".good.{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(small_bundle, tmp)
            tmp.rename(cache / "good")  # whole or not at all
    os.environ["POLICY_BUNDLE_DRILL_BUNDLES"] = str(cache)
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
