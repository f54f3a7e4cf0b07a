"""Helpers shared by the tests: run the real CLI in a fresh process; the mark of a test that needs vLLM."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from policy_bundle.quantize.runtime.vllm_launch import vllm_available

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "policy_bundle.build.cli"]
EXAMPLES = ROOT / "docs" / "examples"  # scripts, not part of the package
SMALL = ("--set", "calibration.samples=64", "--set", "calibration.batch_size=16", "--set", "calibration.golden=64",
         "--set", "export.int8_vllm=false")  # int8-vllm/ (a vLLM load) only where a test asks for it
WITH_INT8_VLLM = ("--set", "export.int8_vllm=auto")
# skipped where vLLM is not installed; under CI (POLICY_BUNDLE_CI=1) conftest makes that skip a failure
needs_vllm = pytest.mark.skipif(not vllm_available(honour_switch=False), reason="vLLM is not installed on this machine")


def run_cli(*args: str, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run the real ``policy-bundle`` CLI in a fresh process."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(CLI + list(args), cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


def shared_tmp(tmp_path_factory) -> Path:
    """A folder every xdist worker of this run sees (the run's base temp; the worker's own without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def load_example(name: str):
    """``docs/examples/<name>.py`` as a module, loaded by its path and left out of ``sys.modules``: the examples
    are scripts outside the package, so Monarch ships the actor classes they define by value, as it does when
    the script runs as ``__main__``."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
