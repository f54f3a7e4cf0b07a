"""Shared fixtures: the cached reference policy, an isolated BentoML store, one small real bundle."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "build.cli"]


def run_cli(*args: str, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run the real ``policy-bundle`` CLI in a fresh process."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(CLI + list(args), cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def bentoml_home(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("bentoml")
    os.environ["BENTOML_HOME"] = str(home)
    return home


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    from quantize.reference import ensure_reference_policy

    return ensure_reference_policy()


SMALL = ("--set", "calibration.samples=64", "--set", "calibration.batch_size=16", "--set", "calibration.golden=64")


@pytest.fixture(scope="session")
def small_bundle(tmp_path_factory, bentoml_home, reference_dir) -> Path:
    out = tmp_path_factory.mktemp("bundles") / "reference"
    res = run_cli("build", "--config", "build/configs/reference.yaml", "--out", str(out), *SMALL)
    assert res.returncode == 0, res.stderr[-3000:]
    return out
